"""Standard Webhooks signatures (https://www.standardwebhooks.com, spec 1.0.0), symmetric scheme ``v1``.

A delivery carries three headers: ``webhook-id`` (the event's stream id: the same on every retry, so a
receiver dedupes by it), ``webhook-timestamp`` (integer Unix seconds of this attempt) and
``webhook-signature``: ``v1,`` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")), several of them
space-separated while a secret is being rotated.

The key: a ``whsec_<base64>`` secret (the spec's serialization) is base64-decoded; any other string is
used as its UTF-8 bytes.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time

WEBHOOK_ID = "webhook-id"
WEBHOOK_TIMESTAMP = "webhook-timestamp"
WEBHOOK_SIGNATURE = "webhook-signature"

SECRET_PREFIX = "whsec_"
SIGNATURE_VERSION = "v1"
#: how far a receiver lets ``webhook-timestamp`` be from its clock (the spec's replay window)
DEFAULT_TOLERANCE_S = 300


def secret_key(secret: str) -> bytes:
    """The HMAC key of ``secret``: a ``whsec_`` secret base64-decoded, else its UTF-8 bytes."""
    if not secret:
        raise ValueError("the webhook secret is empty: give --secret or PAGESTREAM_WEBHOOK_SECRET")
    if secret.startswith(SECRET_PREFIX):
        try:
            return base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)
        except binascii.Error as exc:
            raise ValueError(f"a {SECRET_PREFIX} secret must be base64 after its prefix ({exc})") from None
    return secret.encode()


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value for one attempt: ``v1,<base64 HMAC-SHA256>``."""
    if "." in msg_id:  # the spec: an id must not contain the delimiter
        raise ValueError(f"a webhook id must not contain '.': {msg_id!r}")
    signed = f"{msg_id}.{int(timestamp)}.".encode() + body
    mac = hmac.new(key, signed, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(mac).decode()}"


def signed_headers(key: bytes, msg_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The three Standard Webhooks headers of one attempt (timestamp: now)."""
    ts = int(time.time() if now is None else now)
    return {WEBHOOK_ID: msg_id, WEBHOOK_TIMESTAMP: str(ts), WEBHOOK_SIGNATURE: sign(key, msg_id, ts, body)}


def verify(key: bytes, msg_id: str, timestamp: str, signature_header: str, body: bytes,
           tolerance_s: float = DEFAULT_TOLERANCE_S, now: float | None = None) -> bool:
    """Whether one of the header's ``v1`` signatures is ``body``'s under ``key`` and the timestamp is
    within ``tolerance_s`` of now (a receiver's check; constant-time comparison)."""
    try:
        ts = int(timestamp)
    except (TypeError, ValueError):
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_s or "." in msg_id:
        return False
    expected = sign(key, msg_id, ts, body).encode()
    return any(hmac.compare_digest(expected, candidate.encode())
               for candidate in (signature_header or "").split() if candidate.startswith(f"{SIGNATURE_VERSION},"))
