"""What chat and completions share: a request checked, turned into one job, answered whole or streamed.

``OpenAIServing`` holds the flow (check the model and the queue, submit, wait or stream, cancel
the job when its client goes away); ``OpenAIServingCompletion`` and ``OpenAIServingChat`` supply
only what differs between them: the request model, the ids and object names, the body, the
chunks and the logprobs' layout.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagestream.producer.gateway.asgi import EventStream
from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.gateway.protocol import OpenAIRequest, first_error_loc, usage_chunk
from pagestream.producer.gateway.state import GatewayState
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.tenants import TENANT_FIELD
from pagestream.producer.protocol.schema import JobResult, JobStatus, TokenLogprob, format_validation_error


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def job_error(result: JobResult) -> GatewayError:
    """The answer for a job that ended without completing."""
    if result.status == JobStatus.CANCELLED:
        return GatewayError(499, "the job was cancelled", code="cancelled")
    return GatewayError(500, f"the job {result.status.value}: {result.error}", type="server_error",
                        code=f"job_{result.status.value}")


class OpenAIServing:
    """One endpoint family's request handling over the gateway's shared ``AsyncProducer``."""

    request_model: ClassVar[type[OpenAIRequest]]
    id_prefix: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.settings = state.settings
        self.producer = state.producer
        self.metrics = state.metrics
        self._depth: dict[str, tuple[float, int]] = {}

    # -- what a family supplies ------------------------------------------------------------------

    def body(self, rid: str, model: str, created: int, result: JobResult) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, rid: str, model: str, created: int, index: int, text: str | None, reason: str | None = None,
              logprobs: dict | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def opening_chunks(self, rid: str, model: str, created: int, n: int) -> list[dict[str, Any]]:
        """Chunks sent before any token (chat's role deltas)."""
        return []

    def stream_logprobs(self, lps: list[TokenLogprob], text_offset: int) -> dict:
        raise NotImplementedError

    # -- checks ---------------------------------------------------------------------------------

    def parse(self, data: dict[str, Any]) -> OpenAIRequest:
        try:
            return self.request_model.model_validate(data)
        except ValidationError as exc:
            raise GatewayError(422, format_validation_error(exc), param=first_error_loc(exc)) from None

    async def check_admission(self, model: str) -> None:
        """429 while the model's queue holds ``max_queue_depth`` jobs no worker has taken."""
        limit = self.settings.max_queue_depth
        if limit is not None and await self.queue_depth(model) >= limit:
            raise GatewayError(429, f"the queue for model '{model}' is full ({limit} jobs waiting); retry later",
                               type="rate_limit_error", code="queue_full")

    async def queue_depth(self, model: str) -> int:
        """Jobs on the model's lanes no worker has taken yet (cached for a quarter second)."""
        at, depth = self._depth.get(model, (0.0, 0))
        if time.monotonic() - at < 0.25:
            return depth
        depth = 0
        redis = self.producer.redis
        layout = await self.producer.layout()  # every shard of each lane on a cluster
        for stream in (s for lane in keys.LANES for s in layout.streams(lane, model)):
            try:
                groups = await redis.xinfo_groups(stream)
            except Exception:  # no stream yet
                continue
            lags = [g.get("lag") for g in groups]
            depth += max((lag for lag in lags if lag is not None), default=0) if groups else await redis.xlen(stream)
        self._depth[model] = (time.monotonic(), depth)
        return depth

    # -- the request ----------------------------------------------------------------------------

    async def create(self, request: Request, data: dict[str, Any]) -> Response:
        req = self.parse(data)
        job_id = uuid.uuid4().hex
        try:
            job = req.to_job(job_id)
        except ValidationError as exc:
            raise GatewayError(400, format_validation_error(exc), param=req.param_of(first_error_loc(exc))) from None
        tenant = getattr(request.state, "tenant", None)  # set by the routers' auth dependency
        if tenant is not None:
            job.metadata[TENANT_FIELD] = tenant.name  # the job (its hash and stream) carries its owner
        await self.state.models.check(req.model, job.sampling.max_tokens)
        await self.check_admission(req.model)
        await self.producer.submit(job, queue_unserved=True)  # the model was checked just above, with the directory's cache
        rid = f"{self.id_prefix}-{job_id}"
        created = int(time.time())
        if req.stream:
            return EventStream(self.events(rid, req.model, created, job_id, req.n, req.include_usage),
                               headers={"Cache-Control": "no-cache"})
        result = await self.wait(request, job_id)
        if result.status != JobStatus.COMPLETED:
            raise job_error(result)
        return JSONResponse(self.body(rid, req.model, created, result))

    async def wait(self, request: Request, job_id: str) -> JobResult:
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
            raise GatewayError(504, f"the job did not finish in {self.settings.request_timeout_s} s", type="server_error",
                               code="timeout") from None
        finally:
            if not task.done():
                task.cancel()
                self.state.spawn(self.producer.cancel(job_id))
            elif task.exception() is not None:
                self.state.spawn(self.producer.cancel(job_id))

    async def events(self, rid: str, model: str, created: int, job_id: str, n: int, include_usage: bool) -> AsyncIterator[bytes]:
        self.metrics.streams.inc()
        t0 = time.monotonic()
        finished = False
        try:
            for opening in self.opening_chunks(rid, model, created, n):
                yield sse(opening)
            text_offset: dict[int, int] = {}  # per sample: completions' text_offset of its next token
            events = self.producer.follow(job_id, timeout=self.settings.request_timeout_s)
            async for ev in events:
                lps = None
                if ev.logprobs:
                    offset = text_offset.get(ev.sample, 0)
                    lps = self.stream_logprobs(ev.logprobs, offset)
                    text_offset[ev.sample] = offset + sum(len(t.token) for t in ev.logprobs)
                if ev.text or ev.finish_reason or lps:
                    yield sse(self.chunk(rid, model, created, ev.sample, ev.text, ev.finish_reason, logprobs=lps))
            if events.status == JobStatus.COMPLETED and not include_usage:
                finished = True  # nothing left to say that needs the result (two reads saved per stream)
                yield sse("[DONE]")
                return
            result = await self.producer.result(job_id, timeout=60)
            finished = True
            if result.status != JobStatus.COMPLETED:
                yield sse(job_error(result).body())
            elif include_usage:
                yield sse(usage_chunk(self.chunk_object, rid, model, created, result))
            yield sse("[DONE]")
        finally:
            self.metrics.streams.dec()
            self.metrics.latency.labels("stream").observe(time.monotonic() - t0)
            if not finished:  # the client went away (or the stream failed): stop the job
                self.metrics.disconnect_cancels.inc()
                self.state.spawn(self.producer.cancel(job_id))
