"""The gateway's HTTP plumbing, as plain ASGI: request accounting and the event-stream response.

Both were Starlette's general tools (``@app.middleware("http")`` and ``StreamingResponse``).
Profiled under 64 concurrent streams, those cost more of the gateway's one core than
reading Redis: the middleware runs each request in an anyio task group and passes every
chunk through a memory channel, and the streaming response watches for a disconnect in
another task group. These do the same work with one watcher task per stream.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis
from fastapi.responses import JSONResponse, Response

from pagestream.producer.gateway.errors import GatewayError

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict], Any]


class EventStream(Response):
    """``text/event-stream`` from an async iterator of bytes (or of items ``encode`` turns into bytes: no
    generator between the source and the socket). When the client goes away the iterator is stopped and
    closed, so its ``finally`` runs (the gateway cancels the job there)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[Any], headers: dict[str, str] | None = None,
                 encode: Callable[[Any], bytes] | None = None) -> None:
        self.events = events
        self.encode = encode
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = asyncio.ensure_future(self._body(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((body, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (body, gone):
                task.cancel()
            await asyncio.gather(body, gone, return_exceptions=True)
        if not body.cancelled() and body.exception() is not None:
            raise body.exception()

    async def _body(self, send: Send) -> None:
        encode = self.encode
        try:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk if encode is None else encode(chunk),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()  # stopped at a send: its finally runs now, not when collected


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Accounting:
    """Counts requests by route and status, times those answered in one body (streams time
    themselves), and answers a Redis error raised before the response started with a 503
    (any other error with a 500), in OpenAI's error shape."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        status: int | None = None
        one_body: bool | None = None  # answered in one body message (not a stream)

        async def send_counted(message: dict) -> None:
            nonlocal status, one_body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and one_body is None:
                one_body = not message.get("more_body", False)
            await send(message)

        path = scope["path"]
        try:
            await self.app(scope, receive, send_counted)
        except redis.RedisError as exc:
            if status is not None:
                raise
            log.warning("Redis error on %s: %s", path, exc)
            await _error(GatewayError(503, "the queue is unavailable; retry later", type="server_error",
                                      code="queue_unavailable"))(scope, receive, send_counted)
        except Exception:
            if status is not None:
                raise
            log.exception("unhandled error on %s", path)
            await _error(GatewayError(500, "internal error", type="server_error"))(scope, receive, send_counted)
        finally:
            if status is not None:  # labelled by the route matched, never the raw path (metrics.endpoint_label)
                scope["app"].state.gateway.metrics.observe_request(scope, status, time.monotonic() - t0 if one_body else None)


def _error(exc: GatewayError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)
