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
from pagestream.producer.protocol.schema import JobResult, JobStatus, TokenEvent, TokenLogprob, format_validation_error
from pagestream.producer.protocol.tenants import TENANT_FIELD


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

    def body(self, req: OpenAIRequest, rid: str, created: int, results: list[JobResult]) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, req: OpenAIRequest, rid: str, created: int, index: int, text: str | None, reason: str | None = None,
              logprobs: dict | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def opening_chunks(self, req: OpenAIRequest, rid: str, created: int) -> list[dict[str, Any]]:
        """Chunks sent before any token (chat's role deltas, echoed prompts)."""
        return []

    def stream_logprobs(self, req: OpenAIRequest, lps: list[TokenLogprob], text_offset: int) -> dict:
        raise NotImplementedError

    # -- checks ---------------------------------------------------------------------------------

    def parse(self, data: dict[str, Any]) -> OpenAIRequest:
        try:
            return self.request_model.model_validate(data)
        except ValidationError as exc:  # 400, as vLLM answers a request its models refuse
            raise GatewayError(400, format_validation_error(exc), param=first_error_loc(exc)) from None

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
        arrived = time.time()
        req = self.parse(data)
        # one job per prompt (completions take a list); every check runs before the first is submitted
        job_ids = [uuid.uuid4().hex for _ in range(req.num_jobs())]
        try:
            jobs = req.to_jobs(job_ids)
        except ValidationError as exc:
            raise GatewayError(400, format_validation_error(exc), param=req.param_of(first_error_loc(exc))) from None
        tenant = getattr(request.state, "tenant", None)  # set by the routers' auth dependency
        if tenant is not None:
            for job in jobs:
                job.metadata[TENANT_FIELD] = tenant.name  # each job (its hash and stream) carries its owner
        await self.state.models.check(req.model, jobs[0].sampling.max_tokens)
        await self.state.models.check_tokens(req.model, jobs, req.logit_bias_ids())
        if req.logit_bias:
            raise GatewayError(400, "logit_bias is not applied by this engine yet", param="logit_bias")
        await self.check_admission(req.model)
        for job in jobs:
            await self.producer.submit(job, queue_unserved=True)  # the model was checked just above
        rid = f"{self.id_prefix}-{job_ids[0]}"
        created = int(time.time())
        if req.stream:
            return EventStream(self.events(req, rid, created, job_ids, arrived, jobs[0].sampling.max_tokens),
                               headers={"Cache-Control": "no-cache"})
        results = await self.wait_all(request, job_ids)
        done = time.time()
        for result in results:
            self.metrics.vllm.observe_result(req.model, result, n=req.n, max_tokens=jobs[0].sampling.max_tokens,
                                             arrived=arrived, finished=done)
        return JSONResponse(self.body(req, rid, created, results))

    async def wait_all(self, request: Request, job_ids: list[str]) -> list[JobResult]:
        """Every job's result, in order; the first that fails fails the request and cancels the rest."""
        tasks = [asyncio.ensure_future(self.wait(request, j)) for j in job_ids]
        try:
            results = []
            for t in asyncio.as_completed(tasks):
                result = await t
                if result.status != JobStatus.COMPLETED:
                    raise job_error(result)
                results.append(result)
            return [t.result() for t in tasks]
        finally:
            for t, job_id in zip(tasks, job_ids):
                if not t.done():
                    t.cancel()  # its wait() cancels the job
            await asyncio.gather(*tasks, return_exceptions=True)

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
            elif task.cancelled() or task.exception() is not None:
                self.state.spawn(self.producer.cancel(job_id))

    async def _follow(self, p: int, job_id: str, queue: asyncio.Queue) -> None:
        events = self.producer.follow(job_id, timeout=self.settings.request_timeout_s)
        try:
            async for ev in events:
                await queue.put((p, ev))
            await queue.put((p, events.status))
        except Exception as exc:  # the stream reports it as the job's end
            await queue.put((p, exc))

    async def events(self, req: OpenAIRequest, rid: str, created: int, job_ids: list[str], arrived: float,
                     max_tokens: int | None) -> AsyncIterator[bytes]:
        """The jobs' token events as one stream of chunks (prompt p's sample s is choice p * n + s)."""
        self.metrics.streams.inc()
        t0 = time.monotonic()
        n = req.n
        queue: asyncio.Queue = asyncio.Queue()
        followers = [asyncio.ensure_future(self._follow(p, j, queue)) for p, j in enumerate(job_ids)]
        finished = failed = False
        try:
            for opening in self.opening_chunks(req, rid, created):
                yield sse(opening)
            text_offset: dict[int, int] = {}  # per choice: completions' text_offset of its next token
            generated: dict[int, int] = {}  # per choice: tokens so far (continuous_usage_stats)
            first_token: dict[int, float] = {}  # per prompt: when its first token reached the gateway (vllm: metrics)
            last_token: dict[int, float] = {}
            done: set[int] = set()
            while len(done) < len(job_ids):
                p, ev = await queue.get()
                if not isinstance(ev, TokenEvent):  # the job's end: its status, or the follow's error
                    if ev != JobStatus.COMPLETED:
                        result = await self.producer.result(job_ids[p], timeout=60)
                        if result.status != JobStatus.COMPLETED:
                            failed = True  # one prompt failing fails the request: the rest are cancelled below
                            yield sse(job_error(result).body())
                            yield sse("[DONE]")
                            return
                    done.add(p)
                    continue
                index = p * n + ev.sample
                if ev.token_ids:
                    last_token[p] = time.time()
                    first_token.setdefault(p, last_token[p])
                lps = None
                if ev.logprobs:
                    offset = text_offset.get(index, 0)
                    lps = self.stream_logprobs(req, ev.logprobs, offset)
                    text_offset[index] = offset + sum(len(t.token) for t in ev.logprobs)
                generated[index] = generated.get(index, 0) + len(ev.token_ids)
                if ev.text or ev.finish_reason or lps:
                    chunk = self.chunk(req, rid, created, index, ev.text, ev.finish_reason, logprobs=lps)
                    if req.return_token_ids:
                        chunk["choices"][0]["token_ids"] = ev.token_ids
                    if req.continuous_usage:
                        # completion tokens so far of this choice (the prompt's size comes with the final usage)
                        chunk["usage"] = {"prompt_tokens": 0, "completion_tokens": generated[index],
                                          "total_tokens": generated[index]}
                    yield sse(chunk)
            finished = True
            done_at = time.time()
            results = [await self.producer.result(j, timeout=60) for j in job_ids]  # usage, and vLLM's metrics
            if req.include_usage:
                yield sse(usage_chunk(self.chunk_object, rid, req.model, created, results))
            yield sse("[DONE]")
            for p, result in enumerate(results):
                self.metrics.vllm.observe_result(req.model, result, n=n, max_tokens=max_tokens, arrived=arrived,
                                                 finished=done_at, first_token=first_token.get(p),
                                                 last_token=last_token.get(p))
        finally:
            for f in followers:
                f.cancel()
            self.metrics.streams.dec()
            self.metrics.latency.labels("stream").observe(time.monotonic() - t0)
            if not finished:  # the client went away, a prompt failed, or the stream failed: stop the jobs
                if not failed:
                    self.metrics.disconnect_cancels.inc()
                for j in job_ids:
                    self.state.spawn(self.producer.cancel(j))
