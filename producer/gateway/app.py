"""``pagestream gateway``: an OpenAI-compatible HTTP server that is a producer like any other.

Each request is checked here (JSON, schema, ranges, model served, context length,
queue depth, API key) and becomes one job on the model's lanes; a bad request
gets OpenAI's error shape and never reaches a worker. Streaming responses are
server-sent events built from ``AsyncProducer.follow``, every open stream read
through one shared XREAD (``producer.client.mux``); a client that goes away
has its job cancelled (the worker aborts it within one step, freeing its KV blocks).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagestream.producer.protocol import keys
from pagestream.producer.bulk.rq_queue import BULK_QUEUE
from pagestream.producer.client.producer import AsyncProducer
from pagestream.producer.gateway.asgi import Accounting, EventStream
from pagestream.producer.gateway.batches import add_batch_routes
from pagestream.producer.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GatewayError,
    choice_logprobs,
    chunk,
    completion_body,
    model_list,
    request_param,
    to_job,
    usage_chunk,
)
from pagestream.producer.protocol.redis_conn import connect_async, url_is_cluster
from pagestream.producer.protocol.schema import JobResult, JobStatus, format_validation_error
from pagestream.producer.protocol.untrusted import UntrustedJSONError, loads_untrusted

log = logging.getLogger(__name__)


class GatewaySettings(BaseSettings):
    """Env: ``PAGESTREAM_GATEWAY_`` + field name upper-cased (``PAGESTREAM_GATEWAY_API_KEYS=k1,k2``), and ``REDIS_URL``."""

    model_config = SettingsConfigDict(env_prefix="PAGESTREAM_GATEWAY_", extra="ignore", populate_by_name=True)

    redis_url: str = Field("redis://localhost:6379/0", validation_alias="REDIS_URL")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)  # empty: no key needed
    max_queue_depth: int | None = Field(None, ge=1)  # jobs of one model waiting for a worker; past it: 429
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    request_timeout_s: float = Field(600.0, gt=0)  # a job not finished by then is cancelled, 504
    model_refresh_s: float = Field(1.0, gt=0)  # how long the served-model list is trusted
    # Redis commands in flight at once; past this many, requests wait for a connection. Open streams and
    # waiting requests share one blocking XREAD on a single node (client_mux); on a cluster each holds one.
    redis_max_connections: int = Field(4096, ge=8)
    # /v1/files and /v1/batches: uploads and batch outputs (a directory, or s3://bucket/prefix with S3_ENDPOINT_URL etc.)
    files_uri: str = Field(default_factory=lambda: str(Path.home() / ".cache" / "pagestream" / "files"))
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024)  # OpenAI's limit for a batch input file
    bulk_queue: str = BULK_QUEUE  # the RQ queue ``pagestream bulk-worker`` runs batches from

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        return [k.strip() for k in v.split(",") if k.strip()] if isinstance(v, str) else v


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pagestream_gateway_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.latency = Histogram("pagestream_gateway_request_seconds", "Time to the full response (non-streaming) or the last event",
                                 ["endpoint"], registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.streams = Gauge("pagestream_gateway_open_streams", "Streaming responses in progress", registry=r)
        self.disconnect_cancels = Counter("pagestream_gateway_disconnect_cancels", "Jobs cancelled because their client went away", registry=r)


class ModelDirectory:
    """Models live workers announced, and what they said about them (``max_model_len``), cached briefly."""

    def __init__(self, producer: AsyncProducer, refresh_s: float) -> None:
        self.producer, self.refresh_s = producer, refresh_s
        self._models: dict[str, dict] = {}
        self._until = 0.0

    async def get(self) -> dict[str, dict]:
        if time.monotonic() >= self._until:
            names = await self.producer.live_models()
            infos = await self.producer.redis.hmget(keys.model_info(), names) if names else []
            self._models = {n: _info(raw) for n, raw in zip(names, infos)}
            self._until = time.monotonic() + self.refresh_s
        return self._models


def _info(raw: bytes | None) -> dict:
    try:
        v = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class Gateway:
    """The request handling behind the routes: one AsyncProducer, shared by all requests."""

    def __init__(self, settings: GatewaySettings, producer: AsyncProducer) -> None:
        self.settings = settings
        self.producer = producer
        self.models = ModelDirectory(producer, settings.model_refresh_s)
        self.metrics = GatewayMetrics()
        self._depth: dict[str, tuple[float, int]] = {}
        self._background: set[asyncio.Task] = set()
        self.batches: Any = None  # gateway_batches.BatchRoutes, made on the first /v1/files or /v1/batches call

    # -- checks ---------------------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        if not self.settings.api_keys:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), k.encode()) for k in self.settings.api_keys):
            raise GatewayError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")

    async def read_json(self, request: Request) -> Any:
        limit = self.settings.max_body_bytes
        body = bytearray()
        too_big = False
        async for part in request.stream():
            if not too_big:
                body += part
                too_big = len(body) > limit
        # the whole body was read (and dropped past the limit) so the client gets this answer, not a reset
        if too_big:
            raise GatewayError(413, f"request body is larger than {limit} bytes", code="request_too_large")
        try:
            return loads_untrusted(bytes(body), max_bytes=limit)
        except UntrustedJSONError as exc:
            raise GatewayError(400, f"request body is not acceptable JSON: {exc}") from None

    async def check_model(self, model: str, max_tokens: int | None) -> None:
        served = await self.models.get()
        if model not in served:
            raise GatewayError(404, f"The model '{model}' does not exist or no worker serves it (served: {sorted(served) or 'none'})",
                               param="model", code="model_not_found")
        limit = served[model].get("max_model_len")
        if max_tokens is not None and isinstance(limit, int) and max_tokens >= limit:
            raise GatewayError(400, f"max_tokens ({max_tokens}) leaves no room for the prompt in the model's context of {limit} tokens",
                               param="max_tokens", code="context_length_exceeded")
        if self.settings.max_queue_depth is not None and await self.queue_depth(model) >= self.settings.max_queue_depth:
            raise GatewayError(429, f"the queue for model '{model}' is full ({self.settings.max_queue_depth} jobs waiting); retry later",
                               type="rate_limit_error", code="queue_full")

    async def queue_depth(self, model: str) -> int:
        """Jobs on the model's lanes no worker has taken yet (cached for a quarter second)."""
        at, depth = self._depth.get(model, (0.0, 0))
        if time.monotonic() - at < 0.25:
            return depth
        depth = 0
        layout = await self.producer.layout()  # every shard of each lane on a cluster
        for stream in (s for lane in keys.LANES for s in layout.streams(lane, model)):
            try:
                groups = await self.producer.redis.xinfo_groups(stream)
            except Exception:  # no stream yet
                continue
            lags = [g.get("lag") for g in groups]
            depth += max((lag for lag in lags if lag is not None), default=0) if groups else await self.producer.redis.xlen(stream)
        self._depth[model] = (time.monotonic(), depth)
        return depth

    # -- completions ----------------------------------------------------------------------------------

    async def complete(self, request: Request, chat: bool) -> Response:
        self.check_key(request)
        data = await self.read_json(request)
        if not isinstance(data, dict):
            raise GatewayError(400, "request body must be a JSON object")
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        try:
            req = model_cls.model_validate(data)
        except ValidationError as exc:
            raise GatewayError(422, format_validation_error(exc), param=_first_loc(exc)) from None
        job_id = uuid.uuid4().hex
        try:
            job = to_job(req, job_id)
        except ValidationError as exc:
            raise GatewayError(400, format_validation_error(exc), param=request_param(_first_loc(exc), chat)) from None
        await self.check_model(req.model, job.sampling.max_tokens)
        await self.producer.submit(job, queue_unserved=True)  # checked just above, with the directory's cache
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{job_id}"
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(self._events(chat, rid, req.model, created, job_id, req.n, include_usage),
                               headers={"Cache-Control": "no-cache"})
        result = await self._wait(request, job_id)
        if result.status != JobStatus.COMPLETED:
            raise _job_error(result)
        return JSONResponse(completion_body(chat, rid, req.model, created, result))

    async def _wait(self, request: Request, job_id: str) -> JobResult:
        """The job's result; cancels the job if the client disconnects or the request times out."""
        task = asyncio.ensure_future(self.producer.result(job_id, timeout=self.settings.request_timeout_s))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    self.metrics.disconnect_cancels.inc()
                    raise GatewayError(499, "client closed the request")
        except TimeoutError:
            raise GatewayError(504, f"the job did not finish in {self.settings.request_timeout_s} s", type="server_error", code="timeout") from None
        finally:
            if not task.done():
                task.cancel()
                self._cancel_soon(job_id)
            elif task.exception() is not None:
                self._cancel_soon(job_id)

    def _cancel_soon(self, job_id: str) -> None:
        t = asyncio.get_running_loop().create_task(self.producer.cancel(job_id))
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def _events(self, chat: bool, rid: str, model: str, created: int, job_id: str, n: int, include_usage: bool) -> AsyncIterator[bytes]:
        self.metrics.streams.inc()
        t0 = time.monotonic()
        finished = False
        try:
            if chat:
                for i in range(n):
                    yield _sse(chunk(chat, rid, model, created, i, "", role=True))
            text_offset: dict[int, int] = {}  # per sample: completions' text_offset of its next token
            events = self.producer.follow(job_id, timeout=self.settings.request_timeout_s)
            async for ev in events:
                lps = None
                if ev.logprobs:
                    offset = text_offset.get(ev.sample, 0)
                    lps = choice_logprobs(chat, ev.logprobs, offset)
                    text_offset[ev.sample] = offset + sum(len(t.token) for t in ev.logprobs)
                if ev.text or ev.finish_reason or lps:
                    yield _sse(chunk(chat, rid, model, created, ev.sample, ev.text, ev.finish_reason, logprobs=lps))
            if events.status == JobStatus.COMPLETED and not include_usage:
                finished = True  # nothing left to say that needs the result (two reads saved per stream)
                yield _sse("[DONE]")
                return
            result = await self.producer.result(job_id, timeout=60)
            finished = True
            if result.status != JobStatus.COMPLETED:
                yield _sse(_job_error(result).body())
            elif include_usage:
                yield _sse(usage_chunk(chat, rid, model, created, result))
            yield _sse("[DONE]")
        finally:
            self.metrics.streams.dec()
            self.metrics.latency.labels("stream").observe(time.monotonic() - t0)
            if not finished:  # the client went away (or the stream failed): stop the job
                self.metrics.disconnect_cancels.inc()
                self._cancel_soon(job_id)


def _first_loc(exc: ValidationError) -> str | None:
    errs = exc.errors()
    loc = errs[0].get("loc") if errs else None
    return ".".join(str(x) for x in loc) if loc else None


def _job_error(result: JobResult) -> GatewayError:
    if result.status == JobStatus.CANCELLED:
        return GatewayError(499, "the job was cancelled", code="cancelled")
    return GatewayError(500, f"the job {result.status.value}: {result.error}", type="server_error", code=f"job_{result.status.value}")


def create_app(settings: GatewaySettings | None = None, producer: AsyncProducer | None = None) -> FastAPI:
    """The FastAPI app (``uvicorn`` serves it in ``pagestream gateway``)."""
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if producer is None and url_is_cluster(settings.redis_url):
            # Redis Cluster: one pool per node, each at most redis_max_connections
            client = connect_async(settings.redis_url, max_connections=settings.redis_max_connections)
        elif producer is None:
            pool = aioredis.BlockingConnectionPool.from_url(settings.redis_url, max_connections=settings.redis_max_connections, timeout=30)
            client = aioredis.Redis(connection_pool=pool)
        # one shared XREAD for every open stream and waiting request (client_mux), not one connection each
        gw = app.state.gateway = Gateway(settings, producer or AsyncProducer(client, multiplex_reads=True))
        try:
            yield
        finally:
            await asyncio.gather(*gw._background, return_exceptions=True)
            await gw.producer.aclose()
            if gw.batches is not None:
                gw.batches.close()

    app = FastAPI(title="pagestream gateway", lifespan=lifespan, docs_url=None, redoc_url=None)

    def gw(request: Request) -> Gateway:
        return request.app.state.gateway

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(GatewayError(exc.status_code, str(exc.detail), code=code).body(), status_code=exc.status_code)

    app.add_middleware(Accounting)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        try:
            await gw(request).producer.redis.ping()
        except Exception as exc:  # any failure to reach Redis means not healthy
            return JSONResponse({"status": "unavailable", "error": type(exc).__name__}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(gw(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        g = gw(request)
        g.check_key(request)
        return JSONResponse(model_list(sorted(await g.models.get())))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gw(request).complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gw(request).complete(request, chat=True)

    add_batch_routes(app)
    return app


def run(settings: GatewaySettings) -> None:
    """Serve until interrupted (uvicorn's own signal handling)."""
    import uvicorn

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
