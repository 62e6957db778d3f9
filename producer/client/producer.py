"""Producers: submit jobs to lane streams, follow their tokens, read results, cancel.

``Producer`` is synchronous (redis-py), ``AsyncProducer`` the same API on
``redis.asyncio``; both run the one core in ``producer.client.core`` and differ
only in how they talk to Redis. Submission is idempotent by job id: submitting a
job id that already exists is a no-op that returns the id (a Lua script checks
the job hash and XADDs atomically, so a retried request never enqueues twice).

A job naming a ``model`` goes to that model's lanes and is refused
(``ModelNotServed``) when no live worker announced the model, unless the caller
passes ``queue_unserved=True``. A job without a model goes to the shared lanes.
``stream`` and ``result`` ride out a Redis restart: they back off, reconnect and
resume after the last event they delivered.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import aclosing
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterPipeline as AsyncClusterPipeline

from pagestream.producer.client.core import (
    SCRIPTS,
    TRANSIENT_ERRORS,
    Emit,
    Failed,
    JobNotFound,
    ModelNotServed,
    ProducerCore,
    Sleep,
    Steps,
    build_request,
    call_script,
)
from pagestream.producer.client.mux import StreamMux
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.events import Event, EventType
from pagestream.producer.protocol.lanes import LaneLayout
from pagestream.producer.protocol.redis_conn import connect, connect_async, is_cluster
from pagestream.producer.protocol.schema import JobRequest, JobResult, JobStatus, TokenEvent
from pagestream.producer.protocol.wire import JobSummary, as_str

_ASYNC_PIPELINES = (aioredis.client.Pipeline, AsyncClusterPipeline)

__all__ = ["AsyncJobEvents", "AsyncProducer", "JobEvents", "JobNotFound", "ModelNotServed", "Producer", "build_request"]


def _end_status(end: list) -> JobStatus | None:
    try:
        return JobStatus(end[0][0]) if end and end[0][0] else None
    except ValueError:  # an end entry written by hand with a status we do not know
        return None


def _end_summary(end: list) -> JobSummary | None:
    return end[0][1] if end and _end_status(end) == JobStatus.COMPLETED else None


class JobEvents:
    """What ``Producer.follow`` returns: the job's token events (iterate once); once they are
    exhausted, ``status`` is the status the job's end entry named (None before that, or when
    the job's stream had expired), so a caller need not read the result to know how it ended;
    ``summary``: a completed job's usage and timings from its end entry (``wire.end_summary``; None
    when the worker wrote none), so a caller that needs only those need not read it either."""

    def __init__(self, producer: Producer, steps: Steps) -> None:
        self._producer, self._steps = producer, steps
        self.status: JobStatus | None = None
        self.summary: JobSummary | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        end: list = []
        yield from self._producer._drive(self._steps, end)
        self.status, self.summary = _end_status(end), _end_summary(end)


class AsyncJobEvents:
    """``JobEvents`` for ``AsyncProducer.follow``: an async iterable (iterate once), then ``status``
    and ``summary``. The iterator is the producer's own reader (no generator between it and the
    caller: a gateway stream pays per event for each); closing it ends its reads."""

    def __init__(self, producer: AsyncProducer, steps: Steps) -> None:
        self._producer, self._steps = producer, steps
        self._end: list = []

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._producer._drive(self._steps, self._end)

    @property
    def status(self) -> JobStatus | None:
        return _end_status(self._end)

    @property
    def summary(self) -> JobSummary | None:
        return _end_summary(self._end)


class Producer:
    """Synchronous producer.

    >>> with Producer.from_url("redis://localhost:6379/0") as p:
    ...     job_id = p.submit(prompt="Hello", max_tokens=16, seed=0)
    ...     for ev in p.stream(job_id): print(ev.text, end="")
    ...     p.result(job_id, timeout=30).text
    """

    def __init__(self, client: redis.Redis, reconnect_timeout_s: float = 60.0) -> None:
        self.redis = client
        self.core = ProducerCore(reconnect_timeout_s, cluster=is_cluster(client))
        self._scripts = {name: client.register_script(src) for name, src in SCRIPTS.items()}

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Producer:
        """A producer for ``url``: a single node, or any node of a Redis Cluster (detected)."""
        return cls(connect(url, **kwargs))

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- I/O: the only part that differs from AsyncProducer ---------------------------------

    def _perform(self, op: Any) -> Any:
        if isinstance(op, Sleep):
            time.sleep(op.seconds)
            return None
        try:
            if op.script:
                kw = op.kwargs
                return call_script(self._scripts[op.method], kw["keys"], kw["args"], kw.get("client", self.redis))
            return getattr(op.on if op.on is not None else self.redis, op.method)(*op.args, **op.kwargs)
        except TRANSIENT_ERRORS as exc:
            if op.retry:
                return Failed(exc)
            raise

    def _drive(self, steps: Steps, result: list) -> Iterator[TokenEvent]:
        """Run the core's steps: perform each Call/Sleep, yield each Emit; the return value goes to ``result``."""
        reply = None
        while True:
            try:
                op = steps.send(reply)
            except StopIteration as stop:
                result.append(stop.value)
                return
            if isinstance(op, Emit):
                reply = None
                yield op.event
            else:
                reply = self._perform(op)

    def _run(self, steps: Steps) -> Any:
        result: list = []
        for _ in self._drive(steps, result):
            raise AssertionError("only stream() emits events")
        return result[0]

    # -- API ----------------------------------------------------------------------------------

    def submit(
        self,
        request: JobRequest | dict | None = None,
        *,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        job_id: str | None = None,
        pipeline: redis.client.Pipeline | None = None,
        queue_unserved: bool = False,
        **fields: Any,
    ) -> str:
        """Validate and enqueue one job; returns its id. Raises ``ValueError`` on bad input
        (``ModelNotServed`` for a model no worker serves, unless ``queue_unserved``).

        Keyword fields are JobRequest fields or sampling fields (``max_tokens=8``).
        With ``pipeline`` the XADD is queued there and runs when the caller executes it.
        """
        job = build_request(request, prompt=prompt, messages=messages, job_id=job_id, **fields)
        return self._run(self.core.submit(job, queue_unserved, pipeline))

    def submit_many(self, requests: Iterable[JobRequest | dict], queue_unserved: bool = False) -> list[str]:
        """Validate all, then enqueue in one pipelined round trip. Existing ids are left as they are."""
        return self._run(self.core.submit_many([build_request(r) for r in requests], queue_unserved))

    def status(self, job_id: str) -> JobStatus | None:
        return self._run(self.core.status(job_id))

    def cancel(self, job_id: str) -> JobStatus | None:
        """Ask for a job to stop. A queued job is cancelled at once; a running one within one engine step.

        Returns the status the job had when asked (None if unknown); a final status means nothing changed.
        """
        return self._run(self.core.cancel(job_id))

    def live_models(self) -> list[str]:
        """Models some live worker announced (``pagestream worker --served-model-name``)."""
        return self._run(self.core.live_models())

    def layout(self) -> LaneLayout:
        """This Redis's lane streams: one per lane on a single node, ``lane_shards`` per lane on a cluster."""
        return self._run(self.core.layout())

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for the final result. Raises ``TimeoutError`` after ``timeout`` s, ``JobNotFound`` if unknown."""
        return self._run(self.core.result(job_id, timeout))

    def results(self, job_ids: Iterable[str], timeout: float | None = None) -> list[JobResult]:
        """Wait for many jobs' results at once, returned in the order of ``job_ids``.

        The batch form of ``result`` (for ``submit_many``): one blocking read waits on all of
        the jobs, and results are read in pipelined rounds, so 256 results cost a few round
        trips, not a few each. ``TimeoutError`` if any is unfinished after ``timeout`` s,
        ``JobNotFound`` for an unknown id.
        """
        return self._run(self.core.results(list(job_ids), timeout))

    def stream(self, job_id: str, from_index: int = 0, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Yield the job's token events in order, each token index once, until the job ends.

        Resumable: a subscriber that saw ``N`` tokens reconnects with ``from_index=N``
        (events entirely before N are skipped). ``timeout`` bounds the wait for the
        next event (``TimeoutError``). A Redis restart is ridden out (backoff, then
        reading resumes after the last event delivered). A job submitted with
        ``logprobs=k`` has ``event.logprobs``: one ``TokenLogprob`` per token id.
        """
        yield from self.follow(job_id, from_index, timeout)

    def follow(self, job_id: str, from_index: int = 0, timeout: float | None = None) -> JobEvents:
        """``stream``, and then how the job ended: ``JobEvents.status`` once the events are exhausted."""
        return JobEvents(self, self.core.stream(job_id, from_index, timeout))


    def events(self, from_id: str = "0", job: str | None = None, types: Iterable[EventType | str] | None = None,
               follow: bool = False, block_s: float = 1.0, count: int = 500,
               stop: Callable[[], bool] | None = None) -> Iterator[Event]:
        """The job-event firehose (``producer.protocol.events``), oldest first, after ``from_id``:
        ``"0"`` from the oldest event kept, ``"$"`` from now, else an event's ``id`` (to resume).
        ``job`` and ``types`` keep only that job's / those types' events. Without ``follow`` it ends
        at the stream's end; with it, it blocks for new events (``block_s`` per XREAD) until closed,
        or until ``stop()`` answers True (asked after every read, so within ``block_s``).
        """
        keep = _event_filter(job, types)
        stream = keys.events_stream()
        if from_id == "$":  # pinned now, so events written between two blocking reads are not skipped
            from_id = _last_id(self.redis.xrevrange(stream, count=1))
        while stop is None or not stop():
            entries = _entries(self.redis.xread({stream: from_id}, count=count, block=int(block_s * 1000) if follow else None))
            if not entries and not follow:
                return
            for ev in entries:
                from_id = ev.id
                if keep(ev):
                    yield ev


class AsyncProducer:
    """``Producer`` on redis.asyncio: same methods and exceptions, awaitable; ``stream`` is an async iterator.

    ``multiplex_reads=True`` (for a process that follows many jobs at once, like the gateway):
    every ``stream`` and ``result`` waiting at the same time shares one blocking XREAD
    (``producer.client.mux``) instead of holding a connection each. Ignored on Redis Cluster,
    where one XREAD cannot span the jobs' slots.
    """

    def __init__(self, client: aioredis.Redis, reconnect_timeout_s: float = 60.0, multiplex_reads: bool = False) -> None:
        self.redis = client
        self.core = ProducerCore(reconnect_timeout_s, cluster=is_cluster(client))
        self._scripts = {name: client.register_script(src) for name, src in SCRIPTS.items()}
        self.mux = StreamMux(client) if multiplex_reads and not self.core.cluster else None

    @classmethod
    def from_url(cls, url: str, multiplex_reads: bool = False, **kwargs: Any) -> AsyncProducer:
        return cls(connect_async(url, **kwargs), multiplex_reads=multiplex_reads)

    async def aclose(self) -> None:
        if self.mux is not None:
            await self.mux.aclose()
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- I/O: the only part that differs from Producer ---------------------------------------

    async def _perform(self, op: Any, reads: dict) -> Any:
        if isinstance(op, Sleep):
            await asyncio.sleep(op.seconds)
            return None
        if self.mux is not None and op.method == "xread" and op.on is None and len(op.args[0]) == 1 and op.kwargs.get("block"):
            ((key, last),) = op.args[0].items()
            return await self.mux.read(reads, key, last, op.kwargs.get("count"), op.kwargs["block"])
        try:
            if op.script:
                kw = op.kwargs
                reply = call_script(self._scripts[op.method], kw["keys"], kw["args"], kw.get("client", self.redis))
            else:
                reply = getattr(op.on if op.on is not None else self.redis, op.method)(*op.args, **op.kwargs)
            # a queued command returns its pipeline, and awaiting a cluster pipeline empties it
            return await reply if inspect.isawaitable(reply) and not isinstance(reply, _ASYNC_PIPELINES) else reply
        except TRANSIENT_ERRORS as exc:
            if op.retry:
                return Failed(exc)
            raise

    async def _drive(self, steps: Steps, result: list) -> AsyncIterator[TokenEvent]:
        reads: dict = {}  # this operation's subscriptions in the shared reader (multiplex_reads)
        reply = None
        try:
            while True:
                try:
                    op = steps.send(reply)
                except StopIteration as stop:
                    result.append(stop.value)
                    return
                if isinstance(op, Emit):
                    reply = None
                    yield op.event
                else:
                    reply = await self._perform(op, reads)
        finally:
            if reads:
                self.mux.release(reads)

    async def _run(self, steps: Steps) -> Any:
        result: list = []
        async with aclosing(self._drive(steps, result)) as events:
            async for _ in events:
                raise AssertionError("only stream() emits events")
        return result[0]

    # -- API (docstrings on Producer) -------------------------------------------------------------

    async def submit(
        self,
        request: JobRequest | dict | None = None,
        *,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        job_id: str | None = None,
        pipeline: aioredis.client.Pipeline | None = None,
        queue_unserved: bool = False,
        **fields: Any,
    ) -> str:
        job = build_request(request, prompt=prompt, messages=messages, job_id=job_id, **fields)
        return await self._run(self.core.submit(job, queue_unserved, pipeline))

    async def submit_many(self, requests: Iterable[JobRequest | dict], queue_unserved: bool = False) -> list[str]:
        return await self._run(self.core.submit_many([build_request(r) for r in requests], queue_unserved))

    async def status(self, job_id: str) -> JobStatus | None:
        return await self._run(self.core.status(job_id))

    async def cancel(self, job_id: str) -> JobStatus | None:
        return await self._run(self.core.cancel(job_id))

    async def live_models(self) -> list[str]:
        return await self._run(self.core.live_models())

    async def layout(self) -> LaneLayout:
        return await self._run(self.core.layout())

    async def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        return await self._run(self.core.result(job_id, timeout))

    async def results(self, job_ids: Iterable[str], timeout: float | None = None) -> list[JobResult]:
        return await self._run(self.core.results(list(job_ids), timeout))

    async def stream(self, job_id: str, from_index: int = 0, timeout: float | None = None) -> AsyncIterator[TokenEvent]:
        async for ev in self.follow(job_id, from_index, timeout):
            yield ev

    async def events(self, from_id: str = "0", job: str | None = None, types: Iterable[EventType | str] | None = None,
                     follow: bool = False, block_s: float = 1.0, count: int = 500) -> AsyncIterator[Event]:
        """``Producer.events``, async."""
        keep = _event_filter(job, types)
        stream = keys.events_stream()
        if from_id == "$":
            from_id = _last_id(await self.redis.xrevrange(stream, count=1))
        while True:
            reply = await self.redis.xread({stream: from_id}, count=count, block=int(block_s * 1000) if follow else None)
            entries = _entries(reply)
            if not entries and not follow:
                return
            for ev in entries:
                from_id = ev.id
                if keep(ev):
                    yield ev

    def follow(self, job_id: str, from_index: int = 0, timeout: float | None = None) -> AsyncJobEvents:
        return AsyncJobEvents(self, self.core.stream(job_id, from_index, timeout))


def _event_filter(job: str | None, types: Iterable[EventType | str] | None) -> Callable[[Event], bool]:
    """Which events ``events()`` yields; an unknown type name is a ValueError before anything is read."""
    want = None if types is None else {EventType(t).value for t in types}

    def keep(ev: Event) -> bool:
        return (job is None or ev.job == job) and (want is None or getattr(ev.type, "value", ev.type) in want)

    return keep


def _last_id(newest: list) -> str:
    return as_str(newest[0][0]) if newest else "0-0"


def _entries(reply: Any) -> list[Event]:
    """The events of an XREAD reply on the one events stream (RESP2 list or RESP3 dict)."""
    if isinstance(reply, dict):
        reply = list(reply.items())
    return [Event.parse(entry_id, raw) for entry_id, raw in (reply[0][1] if reply else [])]
