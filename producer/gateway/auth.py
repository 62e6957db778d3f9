"""API-key auth as one FastAPI dependency, put on every router that needs it (``app.py``), so a new
route cannot forget it. It answers who is asking: the key's ``Tenant`` (``producer.protocol.tenants``),
which the files, batches and jobs routes scope every object to."""
from __future__ import annotations

import hmac

from fastapi import Request

from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.protocol.tenants import OPEN, Tenant, key_table


class KeyTable:
    """The configured keys and their tenants, matched in constant time (every key compared, whichever matches)."""

    def __init__(self, specs: list[str]) -> None:
        self._keys = [(key.encode(), tenant) for key, tenant in key_table(specs).items()]

    @property
    def open(self) -> bool:
        return not self._keys

    def tenant(self, token: str) -> Tenant | None:
        given = token.encode()
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(given, key):
                found = tenant
        return found


async def require_api_key(request: Request) -> Tenant:
    """``Authorization: Bearer <key>`` with one of the configured keys: the key's tenant (also put on
    ``request.state.tenant``). No key configured: no key needed, every request is the open tenant.
    ``async`` though it awaits nothing: FastAPI runs a plain ``def`` dependency in its thread pool, a
    thread hop (and a fight for the GIL) on every request."""
    table: KeyTable = request.app.state.gateway.keys
    if table.open:
        tenant = OPEN
    else:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        tenant = table.tenant(token) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise GatewayError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")
    request.state.tenant = tenant
    return tenant
