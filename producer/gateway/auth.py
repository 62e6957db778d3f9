"""API-key auth as one FastAPI dependency, put on every router that needs it (``app.py``), so a new
route cannot forget it."""
from __future__ import annotations

import hmac

from fastapi import Request

from pagestream.producer.gateway.errors import GatewayError


def require_api_key(request: Request) -> None:
    """``Authorization: Bearer <key>`` with one of the configured keys (compared in constant time); none
    configured: no key needed."""
    keys = request.app.state.gateway.settings.api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
        raise GatewayError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")
