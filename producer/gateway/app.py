"""``pagestream gateway``: an OpenAI-compatible HTTP server that is a producer like any other.

Laid out as vLLM's entry points are: one router and one serving class per endpoint family
(``completions/``, ``chat/``, ``responses/``, ``models/``, ``batches/`` for files and batches, ``health/``),
request and response models in ``protocol.py``, API-key auth as one dependency on every ``/v1``
router (``auth.py``), domain errors mapped to HTTP in one place (``errors.py``).

Each request is checked (JSON, schema, ranges, model served, context length, queue depth, API
key) and becomes one job on the model's lanes; a bad request gets OpenAI's error shape and never
reaches a worker. Streaming responses are server-sent events built from ``AsyncProducer.follow``,
every open stream read through one shared XREAD (``producer.client.mux``); a client that goes away
has its job cancelled (the worker aborts it within one step, freeing its KV blocks).
"""
from __future__ import annotations

import asyncio
import gc
import signal
import sys
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import Depends, FastAPI

from pagestream.producer.client import AsyncProducer
from pagestream.producer.gateway import errors
from pagestream.producer.gateway.asgi import Accounting
from pagestream.producer.gateway.auth import require_api_key
from pagestream.producer.gateway.batches.api_router import router as batches_router
from pagestream.producer.gateway.batches.serving import OpenAIServingBatches
from pagestream.producer.gateway.chat.api_router import router as chat_router
from pagestream.producer.gateway.chat.serving import OpenAIServingChat
from pagestream.producer.gateway.completions.api_router import router as completions_router
from pagestream.producer.gateway.completions.serving import OpenAIServingCompletion
from pagestream.producer.gateway.dashboard.api_router import router as dashboard_router
from pagestream.producer.gateway.health.api_router import router as health_router
from pagestream.producer.gateway.invocations.api_router import router as invocations_router
from pagestream.producer.gateway.load import InFlight, ServerLoad
from pagestream.producer.gateway.models.api_router import router as models_router
from pagestream.producer.gateway.models.serving import OpenAIServingModels
from pagestream.producer.gateway.responses.api_router import router as responses_router
from pagestream.producer.gateway.responses.serving import OpenAIServingResponses
from pagestream.producer.protocol import grammar_check
from pagestream.producer.gateway.settings import GatewaySettings
from pagestream.producer.gateway.state import GatewayState
from pagestream.producer.gateway.streams.api_router import router as streams_router
from pagestream.producer.gateway.tokenize.api_router import router as tokenize_router
from pagestream.producer.gateway.tokenize.serving import OpenAIServingTokenization
from pagestream.producer.protocol.redis_conn import connect_async

#: the routers behind the API key, in the order their routes are matched
API_ROUTERS = (models_router, completions_router, chat_router, responses_router, batches_router, invocations_router,
               tokenize_router, streams_router)


def _client(settings: GatewaySettings):
    # a single node: a blocking pool of redis_max_connections; a cluster: one such pool per node
    return connect_async(settings.redis_url, max_connections=settings.redis_max_connections, blocking_pool_timeout=30)


def create_app(settings: GatewaySettings | None = None, producer: AsyncProducer | None = None) -> FastAPI:
    """The FastAPI app (``uvicorn`` serves it in ``pagestream gateway``)."""
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # one shared XREAD for every open stream and waiting request (client/mux), not one connection each
        state = GatewayState(settings, producer or AsyncProducer(_client(settings), multiplex_reads=True))
        state.models = OpenAIServingModels(state)
        state.completions = OpenAIServingCompletion(state)
        state.chat = OpenAIServingChat(state)
        state.responses = OpenAIServingResponses(state)
        state.batches = OpenAIServingBatches(state)
        state.tokenization = OpenAIServingTokenization(state)
        app.state.gateway = state
        # the grammar backend's check of structured specs (producer.protocol.grammar_check) imports xgrammar
        # (and torch, ~2 s) once, before the gateway answers, not on the event loop of a first constrained request
        await asyncio.to_thread(grammar_check.warm_up)
        # what startup built (torch's and xgrammar's modules among it: ~270,000 objects, a full collection
        # ~180 ms on a 2-core VM, against ~70,000 before the grammar check came) lives as long as the process:
        # out of the collector's generations, as vLLM's API server does, so no collection scans it again
        gc.collect()
        gc.freeze()
        state.start()
        try:
            yield
        finally:
            await state.aclose()

    app = FastAPI(title="pagestream gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    errors.install(app)
    app.add_middleware(Accounting)
    app.state.server_load = InFlight()
    app.add_middleware(ServerLoad, counter=app.state.server_load)
    app.include_router(health_router)
    # the live dashboard checks the same keys itself: a browser sends its key as a cookie (dashboard/api_router.py)
    app.include_router(dashboard_router)
    for router in API_ROUTERS:
        app.include_router(router, dependencies=[Depends(require_api_key)])
    return app


class HeaderTooLarge(Exception):
    """A request line plus headers past the gateway's ``max_header_bytes``."""


def _http_protocol(header_timeout_s: float, max_header_bytes: int):
    """uvicorn's httptools protocol (its C parser) within two bounds it lacks: a connection whose first
    request's headers are not complete within ``header_timeout_s`` is closed (uvicorn's keep-alive timer
    covers the requests after the first, not the first: slowloris), and a request line plus headers past
    ``max_header_bytes`` is a 400 (llhttp itself takes headers of any size)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._begin_headers()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _begin_headers(self) -> None:
            self._in_headers = True
            self._received = 0  # bytes that arrived since this request began, while its headers are open
            self._parsed = 0  # its request line and headers, counted as the parser hands them over

        def _header_timeout(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._in_headers:
                self._received += len(data)
            super().data_received(data)
            # still inside one request's headers after all of it, so every byte since its start is a header
            # byte: llhttp holds an unfinished header line without limit, and would wait for ever
            if self._in_headers and self._received > max_header_bytes and not self.transport.is_closing():
                self.send_400_response("Request line and headers are too large.")

        def _count(self, n: int) -> None:
            self._parsed += n
            if self._parsed > max_header_bytes:  # raised through the parser: uvicorn answers 400 and closes
                raise HeaderTooLarge(f"request line and headers past {max_header_bytes} bytes")

        def on_message_begin(self) -> None:
            self._begin_headers()
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:  # exact, once a header is whole
            self._count(len(name) + len(value) + 4)  # "name: value\r\n"
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._header_timer.cancel()  # the first request's headers are in
            self._in_headers = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._begin_headers()  # what arrives next is the next request's
            super().on_message_complete()

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

    return BoundedHttpToolsProtocol


def install_stack_dump(signum: int = signal.SIGUSR1) -> None:
    """On ``signum``, write every thread's stack and every asyncio task's stack to stderr, and go on
    serving: what a gateway that will not answer or will not stop is waiting on (``kill -USR1 PID``)."""
    import faulthandler

    def dump(_signum, _frame) -> None:
        faulthandler.dump_traceback(all_threads=True)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the signal landed outside the loop (startup, shutdown)
            return
        for task in asyncio.all_tasks(loop):
            print(f"Stack for {task!r}:", file=sys.stderr)
            task.print_stack(file=sys.stderr)
        sys.stderr.flush()

    signal.signal(signum, dump)


def run(settings: GatewaySettings, on_started: Callable[[], None] | None = None) -> None:
    """Serve until interrupted (uvicorn's own signal handling), within the settings' connection bounds;
    ``on_started`` runs once the app has started and the socket listens, not before."""
    import uvicorn

    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                            http=_http_protocol(settings.header_timeout_s, settings.max_header_bytes),
                            timeout_keep_alive=settings.keep_alive_timeout_s, limit_concurrency=settings.max_connections,
                            timeout_graceful_shutdown=settings.shutdown_timeout_s)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and on_started is not None:  # the app started and the socket listens
                on_started()

    server = Server(config)
    install_stack_dump()
    # uvicorn re-raises the SIGTERM it caught once it has shut down; as SystemExit(0) (not the default
    # handler's instant death by signal) the caller's cleanup runs and the exit status says "stopped"
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    server.run()
    if not server.started:  # the app's startup or the bind failed (uvicorn said why): as uvicorn.run exits
        sys.exit(3)
