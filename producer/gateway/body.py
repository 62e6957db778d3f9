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
from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.gateway.protocol import check_list_lengths
from pagestream.producer.protocol.errors import RequestError
from pagestream.producer.protocol.untrusted import UntrustedJSONError, loads_untrusted

#: bodies larger than this are checked in a checker process (or, with none, a worker thread) and parsed
#: in a worker thread, not on the event loop: a 4 MB body of a million ``{}`` took ~1.3 s to check there,
#: and /health waited that long
THREAD_PARSE_BYTES = 256 * 1024
#: a request body holds at most this many arrays and objects (a chat of 1,000 messages of 10 parts holds
#: ~11,000); more is refused before ``json.loads`` builds them (a million ``{}`` hold the GIL ~0.1 s to build)
MAX_BODY_CONTAINERS = 100_000
#: a body with more arrays and objects than this (a cheap upper bound, braces counted in strings too) is judged
#: by a checker as if it were large: a 80 kB list of 20,000 prompts cost the event loop ~10 ms to parse and check
INLINE_CONTAINERS = 1024
#: the checker processes' niceness: under a flood they yield the cores to the event loop they protect
CHECKER_NICENESS = 10

#: what a checker says of a body it refuses: ("json", why) or ("request", why, param)
Verdict = tuple


def judge(raw: bytes, limit: int, precheck: Callable[[Any], None] | None) -> Verdict | None:
    """A checker's verdict on a body: ``loads_untrusted``'s, then ``precheck``'s on the parsed body (the
    endpoint's cheap bounds, such as list lengths); None: acceptable. Plain tuples cross the process
    boundary (an exception's own fields would not survive pickling)."""
    try:
        data = loads_untrusted(raw, max_bytes=limit, max_containers=MAX_BODY_CONTAINERS)
    except UntrustedJSONError as exc:
        return ("json", str(exc))
    if precheck is not None:
        try:
            precheck(data)
        except RequestError as exc:
            return ("request", exc.message, exc.param)
    return None


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

    async def check(self, raw: bytes, limit: int, precheck: Callable[[Any], None] | None = None) -> None:
        """Raise ``UntrustedJSONError`` for a body ``loads_untrusted`` would refuse, and ``RequestError`` for
        one ``precheck`` refuses."""
        work = partial(judge, raw, limit, precheck)
        verdict = None
        done = False
        if self.processes:
            pool = self._executor()
            try:
                verdict, done = await asyncio.get_running_loop().run_in_executor(pool, work), True
            except BrokenProcessPool:  # a checker died: a fresh pool for the next body, a thread for this one
                if self._pool is pool:
                    self._pool = None
                    pool.shutdown(wait=False, cancel_futures=True)
        if not done:
            verdict = await run_in_threadpool(work)
        if verdict is not None:
            if verdict[0] == "json":
                raise UntrustedJSONError(verdict[1])
            raise RequestError(verdict[1], param=verdict[2])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _parse(raw: bytes, limit: int) -> Any:
    return loads_untrusted(raw, max_bytes=limit, max_containers=MAX_BODY_CONTAINERS)


async def read_json(request: Request, limit: int, checks: BodyChecks | None = None,
                    precheck: Callable[[Any], None] | None = None) -> Any:
    """The body as JSON: 413 past ``limit`` bytes (the rest is read and dropped, so the client gets the
    answer, not a reset), 400 for anything ``loads_untrusted`` refuses. A large body, or one of many
    arrays and objects, is judged by ``checks`` first (with ``precheck``, the endpoint's cheap bounds, so a
    body they refuse is never parsed here) and parsed in a worker thread."""
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
        if len(raw) <= THREAD_PARSE_BYTES and raw.count(b"{") + raw.count(b"[") <= INLINE_CONTAINERS:
            return _parse(raw, limit)
        if checks is not None:
            await checks.check(raw, limit, precheck)
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


async def openai_request_object(request: Request) -> dict[str, Any]:
    """``json_object`` for an OpenAI request body (completions, chat, responses): a checker that judges it
    also counts its lists (``check_list_lengths``), so a body of 20,000 prompts is refused without being
    parsed in the gateway's process. The serving class counts them again on what it parses (cheap)."""
    state = request.app.state.gateway
    precheck = partial(check_list_lengths, max_choices=state.settings.max_request_choices)
    data = await read_json(request, state.settings.max_body_bytes, state.body_checks, precheck)
    if not isinstance(data, dict):
        raise GatewayError(400, "request body must be a JSON object")
    return data
