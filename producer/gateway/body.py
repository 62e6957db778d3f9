"""Reading a request's JSON body as untrusted input: bounded, parsed by ``loads_untrusted``, a JSON object.

A large body is judged first in a process of its own (``BodyChecks``): counting a hostile body's
containers and parsing it hold the GIL for tens of milliseconds, and a flood of such bodies held
every other request (``/health`` included) that long, each, when that ran in one of the gateway's
threads. Only a body the checker accepts is parsed again here, in a thread, to hand to the endpoint.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.protocol.untrusted import UntrustedJSONError, check_untrusted, loads_untrusted

#: bodies larger than this are checked in a checker process (or, with none, a worker thread) and parsed
#: in a worker thread, not on the event loop: a 4 MB body of a million ``{}`` took ~1.3 s to check there,
#: and /health waited that long
THREAD_PARSE_BYTES = 256 * 1024
#: a request body holds at most this many arrays and objects (a chat of 1,000 messages of 10 parts holds
#: ~11,000); more is refused before ``json.loads`` builds them (a million ``{}`` hold the GIL ~0.1 s to build)
MAX_BODY_CONTAINERS = 100_000
#: the checker processes' niceness: under a flood they yield the cores to the event loop they protect
CHECKER_NICENESS = 10


class BodyChecks:
    """Up to ``processes`` checker processes (spawned, not forked from the gateway's threads, at the first
    large body; each imports the gateway's entry module, ~0.5 s) that judge large bodies; 0 checks them in
    a worker thread instead. A checker that dies (killed, out of
    memory) is replaced at the next body, and that body is checked in a thread meanwhile."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=os.nice, initargs=(CHECKER_NICENESS,))
        return self._pool

    async def check(self, raw: bytes, limit: int) -> None:
        """Raise ``UntrustedJSONError`` for a body ``loads_untrusted`` would refuse."""
        check = partial(check_untrusted, raw, max_bytes=limit, max_containers=MAX_BODY_CONTAINERS)
        if self.processes:
            pool = self._executor()
            try:
                return await asyncio.get_running_loop().run_in_executor(pool, check)
            except BrokenProcessPool:  # a checker died: a fresh pool for the next body, a thread for this one
                if self._pool is pool:
                    self._pool = None
                    pool.shutdown(wait=False, cancel_futures=True)
        await run_in_threadpool(check)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _parse(raw: bytes, limit: int) -> Any:
    return loads_untrusted(raw, max_bytes=limit, max_containers=MAX_BODY_CONTAINERS)


async def read_json(request: Request, limit: int, checks: BodyChecks | None = None) -> Any:
    """The body as JSON: 413 past ``limit`` bytes (the rest is read and dropped, so the client gets the
    answer, not a reset), 400 for anything ``loads_untrusted`` refuses; a large body is judged by
    ``checks`` first and parsed in a worker thread."""
    body = bytearray()
    too_big = False
    async for part in request.stream():
        if not too_big:
            body += part
            too_big = len(body) > limit
    if too_big:
        raise GatewayError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    raw = bytes(body)
    try:
        if len(raw) <= THREAD_PARSE_BYTES:
            return _parse(raw, limit)
        if checks is not None:
            await checks.check(raw, limit)
        return await run_in_threadpool(_parse, raw, limit)
    except UntrustedJSONError as exc:
        raise GatewayError(400, f"request body is not acceptable JSON: {exc}") from None


async def json_object(request: Request) -> dict[str, Any]:
    """FastAPI dependency: the body as a JSON object within the gateway's ``max_body_bytes``."""
    state = request.app.state.gateway
    data = await read_json(request, state.settings.max_body_bytes, state.body_checks)
    if not isinstance(data, dict):
        raise GatewayError(400, "request body must be a JSON object")
    return data
