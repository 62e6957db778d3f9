"""Reading a request's JSON body as untrusted input: bounded, parsed by ``loads_untrusted``, a JSON object."""
from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.protocol.untrusted import UntrustedJSONError, loads_untrusted

#: bodies larger than this are parsed (and their tree checked) in a worker thread, not on the event loop:
#: a 4 MB body of a million ``{}`` took ~1.3 s to check there, and /health waited that long
THREAD_PARSE_BYTES = 256 * 1024
#: a request body holds at most this many arrays and objects (a chat of 1,000 messages of 10 parts holds
#: ~11,000); more is refused before ``json.loads`` builds them (a million ``{}`` hold the GIL ~0.1 s to build)
MAX_BODY_CONTAINERS = 100_000


def _count_containers_past(raw: bytes, cap: int) -> bool:
    """Whether ``raw`` opens more than ``cap`` arrays/objects outside its strings: a cheap upper bound
    first, then the exact count (escapes dropped pair by pair, the text split at its quotes), each step
    one short C call, so a thread doing it lets the event loop run."""
    if raw.count(b"{") + raw.count(b"[") <= cap:
        return False
    outside = raw.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2]
    n = 0
    for part in outside:
        n += part.count(b"{") + part.count(b"[")
        if n > cap:
            return True
    return False


def _parse(raw: bytes, limit: int) -> Any:
    if _count_containers_past(raw, MAX_BODY_CONTAINERS):
        raise UntrustedJSONError(f"more than {MAX_BODY_CONTAINERS} arrays and objects")
    return loads_untrusted(raw, max_bytes=limit)


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON: 413 past ``limit`` bytes (the rest is read and dropped, so the client gets the
    answer, not a reset), 400 for anything ``loads_untrusted`` refuses."""
    body = bytearray()
    too_big = False
    async for part in request.stream():
        if not too_big:
            body += part
            too_big = len(body) > limit
    if too_big:
        raise GatewayError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    parse = partial(_parse, bytes(body), limit)
    try:
        return await run_in_threadpool(parse) if len(body) > THREAD_PARSE_BYTES else parse()
    except UntrustedJSONError as exc:
        raise GatewayError(400, f"request body is not acceptable JSON: {exc}") from None


async def json_object(request: Request) -> dict[str, Any]:
    """FastAPI dependency: the body as a JSON object within the gateway's ``max_body_bytes``."""
    data = await read_json(request, request.app.state.gateway.settings.max_body_bytes)
    if not isinstance(data, dict):
        raise GatewayError(400, "request body must be a JSON object")
    return data
