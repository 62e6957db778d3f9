"""Tenants: who owns a file, a batch or a job (issue 22).

An API key belongs to a tenant. Objects the gateway creates carry their tenant's name (never the key);
every read, list, download, delete and cancel is scoped to it, and another tenant's object is a 404
(``NotFound``: its existence is not revealed). An admin tenant sees everything. An open gateway (no
keys) serves one tenant, ``anonymous``, which sees everything, as before tenants existed.

Key specs (settings ``api_keys`` and the lines of ``api_keys_file``):

- ``key``: the tenant is ``key-<first 16 hex of sha256(key)>``, stable however the list is ordered;
- ``key:tenant``: a named tenant (several keys may share one, for rotation);
- ``key:tenant:admin``: a named tenant that sees every tenant's objects.

A key itself may not contain ``:``.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

#: the one tenant of an open gateway, and the owner of objects made before tenants existed
ANONYMOUS = "anonymous"

#: the field naming the owner in a file record (JSON); the bulk hash's is ``BulkField.TENANT``
TENANT_FIELD = "tenant"

#: tenant names become part of Redis key names: no braces (hash tags), no whitespace
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    admin: bool = False

    def owns(self, owner: str | None) -> bool:
        """May this tenant see an object owned by ``owner`` (``None``: made before tenants existed)?"""
        return self.admin or (owner or ANONYMOUS) == self.name


#: what an open gateway serves every request as
OPEN = Tenant(ANONYMOUS, admin=True)


def tenant_of_key(key: str) -> str:
    """The stable tenant name of a key given without one (a digest prefix: the key never reaches Redis or logs)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def parse_key_spec(spec: str) -> tuple[str, Tenant]:
    """``key``, ``key:tenant`` or ``key:tenant:admin`` -> (key, its tenant); ``ValueError`` says what is wrong
    (without repeating the key)."""
    parts = spec.strip().split(":")
    key = parts[0]
    if not key:
        raise ValueError("an API key spec has an empty key")
    if len(parts) == 1:
        return key, Tenant(tenant_of_key(key))
    if len(parts) > 3 or (len(parts) == 3 and parts[2] != "admin"):
        raise ValueError("an API key spec is key, key:tenant or key:tenant:admin (a key may not contain ':')")
    name = parts[1]
    if not TENANT_NAME.match(name):
        raise ValueError(f"tenant name {name!r} must match {TENANT_NAME.pattern}")
    return key, Tenant(name, admin=len(parts) == 3)


def read_keys_file(path: str | Path) -> list[str]:
    """The key specs of a keys file: one per line, blank lines and ``#`` comments skipped."""
    lines = Path(path).read_text().splitlines()
    return [s for s in (line.split("#", 1)[0].strip() for line in lines) if s]


def key_table(specs: list[str]) -> dict[str, Tenant]:
    """key -> tenant for every spec; one key given twice with different tenants is an error."""
    table: dict[str, Tenant] = {}
    for spec in specs:
        key, tenant = parse_key_spec(spec)
        if table.get(key, tenant) != tenant:
            raise ValueError(f"an API key is given twice, for tenants {table[key].name!r} and {tenant.name!r}")
        table[key] = tenant
    return table
