"""What chat and completions share: a request checked, turned into one job, answered whole or streamed.

``OpenAIServing`` holds the flow (check the model and the queue, submit, wait or stream, cancel
the job when its client goes away); ``OpenAIServingCompletion`` and ``OpenAIServingChat`` supply
only what differs between them: the request model, the ids and object names, the body, the
chunks and the logprobs' layout.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

import redis

from pagestream.producer.client import JobNotFound
from pagestream.producer.gateway.asgi import EventStream
from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.gateway.limits import StreamSlot
from pagestream.producer.protocol.queue_state import queue_state
from pagestream.producer.gateway.protocol import (MAX_LISTED_ERRORS, OpenAIRequest, check_choices, check_list_lengths,
                                                  first_error_loc, usage_chunk)
from pagestream.producer.gateway.state import GatewayState
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.schema import ErrorCode, JobRequest, JobResult, JobStatus, TokenEvent, TokenLogprob, format_validation_error
from pagestream.producer.protocol.tenants import ANONYMOUS, TENANT_FIELD


def sse(obj: dict | str, event_id: str | None = None, event: str | None = None) -> bytes:
    """One SSE event; ``event_id`` (``<job id>:<token index>``) is what a reconnecting client sends back
    as ``Last-Event-ID``; ``event``: the event's name (the Responses API names each by its type)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    head = f"id: {event_id}\n" if event_id is not None else ""
    if event is not None:
        head += f"event: {event}\n"
    return f"{head}data: {data}\n\n".encode()


#: tokens a tokenizer may add to a text prompt (BOS/EOS), and a chat template to its messages
_SPECIAL_SLACK, _TEMPLATE_SLACK = 16, 512


#: the request header that submits a request to run detached: its jobs run to the end even if the client
#: leaves (no resume grace, no cancel); a stream resumes with ``GET /v1/streams/{id}`` while its record lives
DETACH_HEADER = "x-pagestream-detach"


def is_detached(request: Request) -> bool:
    return request.headers.get(DETACH_HEADER, "").strip().lower() in ("1", "true", "yes")


def sse_item(item: tuple[dict | str, str]) -> bytes:
    """One ``chunk_stream`` item ``(chunk, event id)`` as its SSE event."""
    return sse(item[0], item[1])


def event_id(job_id: str, token_index: int) -> str:
    """The SSE id of an event: the job and the tokens of its sample sent so far, counting this event's."""
    return f"{job_id}:{token_index}"


def job_error(result: JobResult) -> GatewayError:
    """The answer for a job that ended without completing."""
    if result.status == JobStatus.CANCELLED:
        return GatewayError(499, "the job was cancelled", code="cancelled")
    if result.error_code == ErrorCode.INVALID_INPUT:  # the request's own fault (vLLM: 400); clients retry a 500
        return GatewayError(400, result.error or "the engine refused the request", code=result.error_code.value)
    return GatewayError(500, f"the job {result.status.value}: {result.error}", type="server_error",
                        code=f"job_{result.status.value}")


def lost_error(exc: BaseException, timeout_s: float) -> GatewayError:
    """The answer for a job whose wait or stream failed: Redis lost it, the request timed out, or Redis
    stayed unreachable (an error event + ``[DONE]`` on a stream, this status otherwise)."""
    if isinstance(exc, JobNotFound):
        return GatewayError(503, f"the job {exc.args[0]} is gone: the queue lost it (Redis restarted without its "
                            "data?); submit the request again", type="server_error", code="job_lost")
    if isinstance(exc, TimeoutError):
        return GatewayError(504, f"the job did not finish in {timeout_s} s", type="server_error", code="timeout")
    if isinstance(exc, redis.RedisError):
        return GatewayError(503, "the queue is unavailable; retry later", type="server_error", code="queue_unavailable")
    return GatewayError(500, "internal error", type="server_error")


@dataclasses.dataclass
class Queued:
    """A request's jobs, submitted: who owns them, its stream slot, when it came, whether it runs detached."""

    job_ids: list[str]
    jobs: list[JobRequest]
    owner: str
    tenant: str | None  # the key's tenant's name (None: no API keys)
    slot: StreamSlot | None
    arrived: float
    created: int
    detached: bool


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

    def lead(self, req: OpenAIRequest, p: int, prompt_lps: list[TokenLogprob] | None) -> tuple[str, list[TokenLogprob]]:
        """The text and logprobs that lead each choice of prompt ``p`` in its first chunk (completions' streamed
        echo); ``prompt_lps``: the prompt's logprobs, when its job streams them."""
        return "", []

    def hides_output(self, req: OpenAIRequest) -> bool:
        """Whether a stream leaves the sampled tokens out (completions' echo with ``max_tokens=0``)."""
        return False

    #: a stream's ``return_token_ids`` puts the prompt's ids on each choice's first chunk (completions), or only
    #: on the stream's first chunk that follows the prompt's first event (chat: once per prompt)
    prompt_ids_per_choice = True

    def put_prompt_token_ids(self, chunk: dict[str, Any], ids: list[int]) -> None:
        """Where a stream's ``return_token_ids`` puts the prompt's ids (see ``prompt_ids_per_choice``)."""

    async def check_request(self, req: OpenAIRequest) -> None:
        """A family's own checks against the served model, before any job is submitted."""

    async def chunker(self, req: OpenAIRequest, rid: str, created: int, job_ids: list[str],
                      resume_from: int | None) -> Callable[..., dict[str, Any] | None]:
        """One stream's ``(index, text, reason, logprobs) -> chunk`` (None: nothing to send yet); a family that
        keeps state over a stream (chat's tool calls) returns its own, caught up to ``resume_from``."""
        return functools.partial(self.chunk, req, rid, created)

    # -- checks ---------------------------------------------------------------------------------

    def parse(self, data: dict[str, Any]) -> OpenAIRequest:
        check_list_lengths(data, self.settings.max_request_choices)  # counted before any deep validation
        try:
            req = self.request_model.model_validate(data)
        except ValidationError as exc:  # 400, as vLLM answers a request its models refuse
            raise GatewayError(400, format_validation_error(exc, max_errors=MAX_LISTED_ERRORS),
                               param=first_error_loc(exc)) from None
        check_choices(req, self.settings.max_request_choices)
        return req

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
        # every shard of each lane on a cluster; the figures /metrics shows as pagestream_queue_depth
        lanes = await queue_state(self.producer.redis, await self.producer.layout(), model, ages=False)
        depth = sum(q.depth for q in lanes.values())
        self._depth[model] = (time.monotonic(), depth)
        return depth

    # -- the request ----------------------------------------------------------------------------

    def response_id(self, job_id: str) -> str:
        """The answer's id for a request whose first job is ``job_id``."""
        return f"{self.id_prefix}-{job_id}"

    async def answer(self, req: OpenAIRequest, rid: str, created: int, results: list[JobResult]) -> dict[str, Any]:
        """A whole (not streamed) answer's body; a family that stores its answers (responses) does it here."""
        return self.body(req, rid, created, results)

    async def create(self, request: Request, data: dict[str, Any]) -> Response:
        return await self.serve(request, data, self.parse(data))

    def detaches(self, request: Request, req: OpenAIRequest) -> bool:
        """Whether the request's jobs run on when its client leaves (no leases, no cancel)."""
        return is_detached(request)

    def prepare_jobs(self, req: OpenAIRequest, jobs: list[JobRequest]) -> None:
        """A family's last word on its jobs before they are submitted (responses: a background job's result
        lives as long as the stored response)."""

    async def serve(self, request: Request, data: dict[str, Any], req: OpenAIRequest) -> Response:
        """``req`` (parsed from ``data``) checked, queued and answered, whole or streamed."""
        queued = await self.queue(request, req)
        if req.stream:
            return await self.stream_response(request, data, req, queued)
        return await self.whole_response(request, req, queued)

    async def queue(self, request: Request, req: OpenAIRequest) -> Queued:
        """Every check, then the request's jobs submitted (all or none)."""
        arrived = time.time()
        # one job per prompt (completions take a list); every check runs before the first is submitted
        job_ids = [uuid.uuid4().hex for _ in range(req.num_jobs())]
        try:
            jobs = req.to_jobs(job_ids)
        except ValidationError as exc:
            raise GatewayError(400, format_validation_error(exc, max_errors=MAX_LISTED_ERRORS),
                               param=req.param_of(first_error_loc(exc))) from None
        tenant = getattr(request.state, "tenant", None)  # set by the routers' auth dependency
        if tenant is not None:
            for job in jobs:
                job.metadata[TENANT_FIELD] = tenant.name  # each job (its hash and stream) carries its owner
        await self.state.models.check(req.model, jobs[0].sampling.max_tokens)
        await self.check_truncation(req.model, jobs)  # before the checks that count a prompt's ids
        await self.state.models.check_tokens(req.model, jobs, req.logit_bias_ids())
        await self.check_context(req.model, jobs)
        await self.check_request(req)
        await self.check_admission(req.model)
        owner = tenant.name if tenant is not None else ANONYMOUS
        context_len = (await self.state.models.served()).get(req.model, {}).get("max_model_len")
        # the tenant's limits, all counted at once before anything is queued (429 past one)
        slot = await self.state.admission.admit(owner, jobs, context_len if isinstance(context_len, int) else None,
                                                stream=bool(req.stream))
        queued: list[str] = []
        self.prepare_jobs(req, jobs)
        try:
            for job in jobs:
                await self.producer.submit(job, queue_unserved=True)  # the model was checked just above
                queued.append(job.job_id)
        except BaseException:  # the request's jobs are one unit: those already queued are cancelled
            await asyncio.shield(self._cancel_all(queued))
            await self.state.admission.release(owner, [j.job_id for j in jobs])
            if slot is not None:
                await self.state.admission.drop_stream(slot)
            raise
        return Queued(job_ids, jobs, owner, tenant.name if tenant is not None else None, slot, arrived,
                      int(time.time()), self.detaches(request, req))

    async def stream_response(self, request: Request, data: dict[str, Any], req: OpenAIRequest, q: Queued) -> Response:
        record = {"tenant": q.tenant, "family": self.id_prefix, "created": q.created, "body": data,
                  "detached": q.detached}
        pipe = self.producer.redis.pipeline(transaction=False)  # the record and the first lease: one round trip
        pipe.set(keys.stream_record(q.job_ids[0]), json.dumps(record), ex=int(self.settings.request_timeout_s) + 600)
        if not q.detached:
            lease_key, leases = self.state.leases.lease_args(q.job_ids)
            pipe.zadd(lease_key, leases, gt=True)
        await pipe.execute()
        return self.event_stream(req, self.response_id(q.job_ids[0]), q.created, q.job_ids, q.arrived,
                                 q.jobs[0].sampling.max_tokens, owner=q.owner, slot=q.slot, detached=q.detached)

    async def whole_response(self, request: Request, req: OpenAIRequest, q: Queued) -> Response:
        results = await self.wait_all(request, q.job_ids, q.detached)
        done = time.time()
        for result in results:
            self.metrics.vllm.observe_result(req.model, result, n=req.n, max_tokens=q.jobs[0].sampling.max_tokens,
                                             arrived=q.arrived, finished=done)
        return JSONResponse(await self.answer(req, self.response_id(q.job_ids[0]), q.created, results))

    async def _cancel_all(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            with contextlib.suppress(Exception):
                await self.producer.cancel(job_id)

    async def check_truncation(self, model: str, jobs: list[JobRequest]) -> None:
        """vLLM's ``truncate_prompt_tokens`` against the context the model's workers announce: -1 becomes that
        length, more than it is a 400 (vLLM's sentence), and a token-id prompt is cut here, so the vocabulary and
        context checks see the ids the worker will run (a text or chat prompt is cut by the worker, right after it
        tokenizes it; the engine checks the count again, for a producer that is not this gateway)."""
        asked = [job for job in jobs if job.truncate_prompt_tokens is not None]
        if not asked:
            return
        limit = (await self.state.models.served()).get(model, {}).get("max_model_len")
        if not isinstance(limit, int):
            return  # not announced: the worker resolves -1 and refuses too large a count itself
        for job in asked:
            k = job.truncate_prompt_tokens
            if k > limit:
                raise GatewayError(400, f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({limit}). "
                                   "Please, select a smaller truncation size.", param="truncate_prompt_tokens")
            job.truncate_prompt_tokens = limit if k == -1 else k
            if job.prompt_token_ids is not None:
                job.prompt_token_ids = job.truncated_prompt_ids(job.prompt_token_ids)

    async def check_context(self, model: str, jobs: list[JobRequest]) -> None:
        """400 before anything is queued for a prompt that, with ``max_tokens``, does not fit the model's
        context: exact for token ids; for text a worker's tokenizer counts it, asked only when a bound
        (a token is at least one byte; a template adds a few hundred at most) says it may not fit."""
        limit = (await self.state.models.served()).get(model, {}).get("max_model_len")
        if not isinstance(limit, int):
            return
        for job in jobs:
            max_new = job.sampling.max_tokens or 0  # none: as many as fit (vLLM's default)
            if job.prompt_token_ids is not None:
                n: int | None = len(job.prompt_token_ids)
            else:
                if job.messages is not None:
                    bound = len(json.dumps([m.model_dump() for m in job.messages]).encode()) + _TEMPLATE_SLACK
                else:
                    bound = len((job.prompt or "").encode()) + _SPECIAL_SLACK
                kept = job.truncate_prompt_tokens if job.truncate_prompt_tokens is not None else bound
                if min(bound, kept) + max(max_new, 1) <= limit:
                    continue
                n = await self.state.tokenization.prompt_len(model, job)
                if n is not None and job.truncate_prompt_tokens is not None:
                    n = min(n, job.truncate_prompt_tokens)  # what the worker keeps of it
            if n is not None and (n >= limit or n + max_new > limit):
                where = "messages" if job.messages is not None else "prompt"
                raise GatewayError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                   f"{n + max_new} tokens ({n} in the {where}, {max_new} in the completion). "
                                   f"Please reduce the length of the {where} or completion.", param=where,
                                   code=ErrorCode.INVALID_INPUT.value)

    async def wait_all(self, request: Request, job_ids: list[str], detached: bool = False) -> list[JobResult]:
        """Every job's result, in order; the first that fails fails the request and cancels the rest."""
        tasks = [asyncio.ensure_future(self.wait(request, j, detached)) for j in job_ids]
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

    async def wait(self, request: Request, job_id: str, detached: bool = False) -> JobResult:
        """The job's result; cancels the job if the client disconnects or the request times out (a
        detached job runs on when its client leaves: its result stays readable for its TTL)."""
        task = asyncio.ensure_future(self.producer.result(job_id, timeout=self.settings.request_timeout_s))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    result = task.result()
                    tenant = getattr(request.state, "tenant", None)
                    await self.state.admission.release(tenant.name if tenant else ANONYMOUS, [job_id])  # final
                    return result
                if await request.is_disconnected():
                    if not detached:
                        self.metrics.disconnect_cancels.inc()
                    raise GatewayError(499, "client closed the request")
        except (TimeoutError, JobNotFound) as exc:
            raise lost_error(exc, self.settings.request_timeout_s) from None
        finally:
            keep = detached  # whatever ends this wait (the client gone, the handler cancelled), the job runs on
            if not task.done():
                task.cancel()
                if not keep:
                    self.state.spawn(self.producer.cancel(job_id))
            elif (task.cancelled() or task.exception() is not None) and not keep:
                self.state.spawn(self.producer.cancel(job_id))

    async def _follow(self, p: int, job_id: str, from_index: int = 0,
                      summaries: list | None = None) -> AsyncIterator[tuple[int, Any]]:
        """``(p, event)`` for each of the job's token events, then ``(p, how it ended)``: its status, or the
        error that ended the read (the stream reports it as the job's end); ``summaries[p]``: the completed
        job's summary from its end entry (``wire.end_summary``)."""
        follow = self.producer.follow(job_id, from_index, timeout=self.settings.request_timeout_s)
        try:
            async with contextlib.aclosing(aiter(follow)) as events:
                async for ev in events:
                    yield p, ev
        except Exception as exc:
            yield p, exc
        else:
            if summaries is not None:
                summaries[p] = follow.summary
            yield p, follow.status

    async def _job_events(self, job_ids: list[str], from_index: int,
                          summaries: list | None = None) -> AsyncIterator[tuple[int, Any]]:
        """Every job's ``_follow`` interleaved as they arrive (a stream of several prompts; ``chunk_stream``
        reads a one-job stream's events in place)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, job_id: str) -> None:
            async with contextlib.aclosing(self._follow(p, job_id, from_index, summaries)) as events:
                async for item in events:
                    await queue.put(item)

        followers = [asyncio.ensure_future(pump(p, j)) for p, j in enumerate(job_ids)]
        try:
            while True:
                yield await queue.get()
        finally:
            for f in followers:
                f.cancel()

    def event_stream(self, req: OpenAIRequest, rid: str, created: int, job_ids: list[str], arrived: float,
                     max_tokens: int | None, resume_from: int | None = None, owner: str = ANONYMOUS,
                     slot: StreamSlot | None = None, detached: bool = False) -> EventStream:
        """The streamed answer: ``chunk_stream``'s items encoded as server-sent events at the socket (no generator
        between them; closed with this stream: its ``finally`` runs when the client goes)."""
        return EventStream(self.chunk_stream(req, rid, created, job_ids, arrived, max_tokens, resume_from, owner,
                                             slot, detached), headers={"Cache-Control": "no-cache"}, encode=sse_item)

    async def chunk_stream(self, req: OpenAIRequest, rid: str, created: int, job_ids: list[str], arrived: float,
                           max_tokens: int | None, resume_from: int | None = None, owner: str = ANONYMOUS,
                           slot: StreamSlot | None = None,
                           detached: bool = False) -> AsyncIterator[tuple[dict | str, str]]:
        """The jobs' token events as one stream of ``(chunk, event id)`` (prompt p's sample s is choice p * n + s);
        ``resume_from``: a resumed single-job stream, its tokens after that index only. ``owner``'s limits
        count the jobs until each is seen final, and ``slot`` (its stream) while the stream is open."""
        self.metrics.streams.inc()
        t0 = time.monotonic()
        n = req.n
        # each job's summary (usage, timings) from its end entry: the result is read only where one is missing
        summaries: list = [None] * len(job_ids)
        if len(job_ids) == 1:  # the usual stream: its job's events read in place, no task or queue between
            follow = self.producer.follow(job_ids[0], resume_from or 0, timeout=self.settings.request_timeout_s)
            job_events = aiter(follow)
        else:
            follow, job_events = None, self._job_events(job_ids, resume_from or 0, summaries)
        finished = failed = False
        # leased while this client is connected; a detached stream's jobs hold none: they outlive their client
        if not detached:
            self.state.leases.hold(job_ids)
        held = asyncio.ensure_future(self.state.admission.hold_stream(slot)) if slot is not None else None
        last_id = event_id(job_ids[0], resume_from or 0)  # the last event's id (error, usage and [DONE] repeat it)
        try:
            chunk_of = await self.chunker(req, rid, created, job_ids, resume_from)
            openings = self.opening_chunks(req, rid, created) if resume_from is None else []
            if not req.continuous_usage:
                for opening in openings:
                    yield opening, last_id
                openings = []
            # else vLLM's: they wait for the job's first event, whose prompt size their usage carries (0 tokens so far)
            text_offset: dict[int, int] = {}  # per choice: completions' text_offset of its next token
            generated: dict[int, int] = {}  # per choice: tokens so far (continuous_usage_stats)
            first_token: dict[int, float] = {}  # per prompt: when its first token reached the gateway (vllm: metrics)
            last_token: dict[int, float] = {}
            done: set[int] = set()
            prompt_lps: dict[int, list[TokenLogprob]] = {}  # per prompt: its logprobs, from its job's first event
            led: set[int] = set()  # choices whose first chunk went out (a resumed stream's went out before)
            prompt_size: dict[int, int] = {}  # per prompt: its tokens, from its job's first event
            prompt_ids: dict[int, list[int]] = {}  # the same, its ids (return_token_ids)
            ids_sent: set[int] = set()  # choices (chat: -1 - prompt) whose chunk carried the prompt's ids
            hide = self.hides_output(req)
            while len(done) < len(job_ids):
                if follow is None:
                    p, ev = await anext(job_events)
                else:  # as ``_follow`` reports it: each event, then the job's status or the error that ended it
                    p = 0
                    try:
                        ev = await anext(job_events)
                    except StopAsyncIteration:
                        ev, summaries[0] = follow.status, follow.summary
                    except Exception as exc:
                        ev = exc
                if not isinstance(ev, TokenEvent):  # the job's end: its status, or the follow's error
                    if isinstance(ev, (JobStatus, JobNotFound)):  # final, or gone: it stops counting
                        await self.state.admission.release(owner, [job_ids[p]])
                    if ev != JobStatus.COMPLETED:
                        error = None
                        if isinstance(ev, BaseException):
                            error = lost_error(ev, self.settings.request_timeout_s)
                        else:
                            try:
                                result = await self.producer.result(job_ids[p], timeout=60)
                            except (TimeoutError, JobNotFound, redis.RedisError) as exc:
                                error = lost_error(exc, 60)
                            else:
                                if result.status != JobStatus.COMPLETED:
                                    error = job_error(result)
                        if error is not None:
                            failed = True  # one prompt failing fails the request: the rest are cancelled below
                            yield error.body(), last_id
                            yield "[DONE]", last_id
                            return
                    done.add(p)
                    continue
                index = p * n + ev.sample
                if ev.prompt_logprobs is not None:
                    prompt_lps.setdefault(p, ev.prompt_logprobs)
                if ev.prompt_tokens is not None:
                    prompt_size.setdefault(p, ev.prompt_tokens)
                if ev.prompt_token_ids is not None:
                    prompt_ids.setdefault(p, ev.prompt_token_ids)
                if openings:
                    size = prompt_size.get(p, 0)
                    for opening in openings:
                        opening["usage"] = {"prompt_tokens": size, "completion_tokens": 0, "total_tokens": size}
                        yield opening, last_id
                    openings = []
                if ev.token_ids:
                    last_token[p] = time.time()
                    first_token.setdefault(p, last_token[p])
                text, token_lps, token_ids = ("", [], []) if hide else (ev.text, ev.logprobs or [], ev.token_ids)
                if resume_from is None and index not in led:
                    led.add(index)
                    lead_text, lead_lps = self.lead(req, p, prompt_lps.get(p))
                    text, token_lps = lead_text + text, [*lead_lps, *token_lps]
                lps = None
                if token_lps:
                    offset = text_offset.get(index, 0)
                    lps = self.stream_logprobs(req, token_lps, offset)
                    text_offset[index] = offset + sum(len(t.token) for t in token_lps)
                generated[index] = generated.get(index, 0) + len(ev.token_ids)
                if text or ev.finish_reason or lps:
                    chunk = chunk_of(index, text, ev.finish_reason, logprobs=lps)
                    if chunk is None:
                        continue
                    if req.return_token_ids:
                        chunk["choices"][0]["token_ids"] = token_ids
                        sent_key = index if self.prompt_ids_per_choice else -1 - p
                        if resume_from is None and sent_key not in ids_sent and p in prompt_ids:
                            ids_sent.add(sent_key)
                            self.put_prompt_token_ids(chunk, prompt_ids[p])
                    if req.continuous_usage:
                        # vLLM's: the prompt's size (its job's first event brought it), this choice's tokens so far
                        size = prompt_size.get(p, 0)
                        chunk["usage"] = {"prompt_tokens": size, "completion_tokens": generated[index],
                                          "total_tokens": size + generated[index]}
                    last_id = event_id(job_ids[p], ev.end_index)
                    yield chunk, last_id
            finished = True
            done_at = time.time()
            # usage, and vLLM's metrics: from the end entries; the results only for a job whose entry had none
            # (an older worker's), or whose end was not read from its stream
            results = summaries if None not in summaries else await self.producer.results(job_ids, timeout=60)
            if req.include_usage:
                yield usage_chunk(self.chunk_object, rid, req.model, created, results,
                                  self.settings.enable_prompt_tokens_details), last_id
            yield "[DONE]", last_id
            for p, result in enumerate(results):
                self.metrics.vllm.observe_result(req.model, result, n=n, max_tokens=max_tokens, arrived=arrived,
                                                 finished=done_at, first_token=first_token.get(p),
                                                 last_token=last_token.get(p))
        finally:
            await job_events.aclose()
            if held is not None:
                held.cancel()  # the stream's slot is free
            self.metrics.streams.dec()
            self.metrics.latency.labels("stream").observe(time.monotonic() - t0)
            # finished: the leases go; a prompt or the stream failed: the jobs are cancelled now; the client
            # went away: cancelled now, or once the resume grace passes without a client back (stream_leases)
            if finished and not detached:
                self.state.leases.finish(job_ids)
            elif not finished and (not detached or failed):
                self.state.spawn(self.state.leases.left(job_ids, failed, held=not detached))


async def resume(state: GatewayState, request: Request, job_id: str) -> Response:
    """``GET /v1/streams/{job_id}``: a streamed request's events after ``Last-Event-ID`` (``<job id>:<token
    index>``; none: from the start), from any gateway; 404 for an unknown job or another tenant's."""
    raw = await state.producer.redis.get(keys.stream_record(job_id))
    record = json.loads(raw) if raw else None
    tenant = getattr(request.state, "tenant", None)
    if record is None or (tenant is not None and not tenant.owns(record["tenant"])):
        raise GatewayError(404, f"no stream for job '{job_id}'", code="not_found")
    families = {state.chat.id_prefix: state.chat, state.completions.id_prefix: state.completions}
    serving = families.get(record["family"])
    if serving is None:  # a /v1/responses stream: its events are numbered from the start, not resumable by token
        raise GatewayError(400, f"the stream of job '{job_id}' ({record['family']}) cannot be resumed", code="not_resumable")
    req = serving.parse(record["body"])
    if req.num_jobs() != 1 or req.n != 1:
        raise GatewayError(400, "only a stream of one prompt and n=1 can be resumed", param="n")
    last = request.headers.get("last-event-id")
    from_index = 0
    if last:
        owner, _, index = last.rpartition(":")
        if owner != job_id or not index.isascii() or not index.isdigit():
            raise GatewayError(400, f"Last-Event-ID must be '{job_id}:<token index>'", param="Last-Event-ID")
        from_index = int(index)
    rid = f"{serving.id_prefix}-{job_id}"
    owner = record["tenant"] or ANONYMOUS
    slot = await state.admission.admit(tenant.name if tenant is not None else owner, [], None, stream=True)
    return serving.event_stream(req, rid, record["created"], [job_id], time.time(), None, from_index,
                                owner=owner, slot=slot, detached=bool(record.get("detached")))
