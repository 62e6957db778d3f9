"""Reading a request's JSON body as untrusted input: bounded, parsed by ``loads_untrusted``, a JSON object."""
from __future__ import annotations

from typing import Any

from fastapi import Request

from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.protocol.untrusted import UntrustedJSONError, loads_untrusted


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
    try:
        return loads_untrusted(bytes(body), max_bytes=limit)
    except UntrustedJSONError as exc:
        raise GatewayError(400, f"request body is not acceptable JSON: {exc}") from None


async def json_object(request: Request) -> dict[str, Any]:
    """FastAPI dependency: the body as a JSON object within the gateway's ``max_body_bytes``."""
    data = await read_json(request, request.app.state.gateway.settings.max_body_bytes)
    if not isinstance(data, dict):
        raise GatewayError(400, "request body must be a JSON object")
    return data
