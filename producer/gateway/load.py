"""Server load as vLLM's ``/load`` reports it: the requests to the generating endpoints now in flight,
counted from their start until their last byte is sent (a stream counts until it ends)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: the routes whose requests count (vLLM counts its ``load_aware_call`` endpoints: the generating ones)
LOAD_AWARE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})


class InFlight:
    """The count ``/load`` answers as ``server_load`` (on ``app.state.server_load``)."""

    def __init__(self) -> None:
        self.in_flight = 0


class ServerLoad:
    """ASGI middleware keeping ``counter.in_flight``."""

    def __init__(self, app: Callable, counter: InFlight) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] not in LOAD_AWARE_PATHS:
            await self.app(scope, receive, send)
            return
        self.counter.in_flight += 1  # one event loop: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.in_flight -= 1
