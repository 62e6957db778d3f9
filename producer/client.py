"""Producers: submit jobs to lane streams, follow their tokens, read results, cancel.

``Producer`` is synchronous (redis-py), ``AsyncProducer`` the same API on
``redis.asyncio``. Submission is idempotent by job id: submitting a job id that
already exists is a no-op that returns the id (a Lua script checks the job hash
and XADDs atomically, so a retried request never enqueues twice).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import redis
import redis.asyncio as aioredis

from pagestream.producer import keys
from pagestream.producer.schema import JobRequest, JobResult, JobStatus, TokenEvent
from pagestream.producer.wire import EventDeduper, decode_out_entry, job_fields

# KEYS: job hash, lane stream. ARGV: job json, lane, created_at, result_ttl_s
_SUBMIT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('HGET', KEYS[1], 'entry_id') or ''}
end
local id = redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[1], 'status', 'queued', 'lane', ARGV[2], 'entry_id', id,
           'created_at', ARGV[3], 'result_ttl_s', ARGV[4])
return {1, id}
"""

# KEYS: job hash, out stream, cancel stream. ARGV: job id, result json (if still queued), now
_CANCEL_LUA = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return false end
if st == 'completed' or st == 'failed' or st == 'cancelled' or st == 'expired' then return st end
redis.call('HSET', KEYS[1], 'cancel_requested', ARGV[3])
if st == 'queued' then
  local ttl = tonumber(redis.call('HGET', KEYS[1], 'result_ttl_s') or '86400')
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'result', ARGV[2], 'finished_at', ARGV[3])
  redis.call('XADD', KEYS[2], '*', 'type', 'end', 'status', 'cancelled')
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', '10000', '*', 'job_id', ARGV[1])
return st
"""


class JobNotFound(KeyError):
    """No job with this id (never submitted, or its result TTL passed)."""


def build_request(request: JobRequest | dict | None = None, **fields: Any) -> JobRequest:
    # Keywords left at None (submit's prompt=None, messages=None, job_id=None) were not given.
    fields = {k: v for k, v in fields.items() if v is not None}
    if request is None:
        return JobRequest(**fields)
    if isinstance(request, dict):
        return JobRequest.model_validate({**request, **fields})
    if fields:
        raise TypeError("pass either a JobRequest or keyword fields, not both")
    return request


def _s(v: bytes | str | None) -> str | None:
    return v.decode("utf-8") if isinstance(v, bytes) else v


def _cancel_result(job_id: str) -> str:
    return JobResult(job_id=job_id, status=JobStatus.CANCELLED, error="cancelled before it started").model_dump_json()


class Producer:
    """Synchronous producer.

    >>> p = Producer.from_url("redis://localhost:6379/0")
    >>> job_id = p.submit(prompt="Hello", max_tokens=16, seed=0)
    >>> for ev in p.stream(job_id): print(ev.text, end="")
    >>> p.result(job_id, timeout=30).text
    """

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._submit = client.register_script(_SUBMIT_LUA)
        self._cancel = client.register_script(_CANCEL_LUA)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Producer:
        return cls(redis.Redis.from_url(url, **kwargs))

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit_args(self, job: JobRequest) -> tuple[list[str], list[Any]]:
        return (
            [keys.job_hash(job.job_id), keys.jobs_stream(job.lane.value)],
            [job_fields(job)["job"], job.lane.value, repr(job.created_at), job.result_ttl_s],
        )

    def submit(
        self,
        request: JobRequest | dict | None = None,
        *,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        job_id: str | None = None,
        pipeline: redis.client.Pipeline | None = None,
        **fields: Any,
    ) -> str:
        """Validate and enqueue one job; returns its id. Raises ``ValueError`` on bad input.

        Keyword fields are JobRequest fields or sampling fields (``max_tokens=8``).
        With ``pipeline`` the XADD is queued there and runs when the caller executes it.
        """
        job = build_request(request, prompt=prompt, messages=messages, job_id=job_id, **fields)
        k, a = self._submit_args(job)
        self._submit(keys=k, args=a, client=pipeline or self.redis)
        return job.job_id

    def submit_many(self, requests: Iterable[JobRequest | dict]) -> list[str]:
        """Validate all, then enqueue in one pipelined round trip. Existing ids are left as they are."""
        jobs = [build_request(r) for r in requests]
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            k, a = self._submit_args(job)
            self._submit(keys=k, args=a, client=pipe)
        pipe.execute()
        return [j.job_id for j in jobs]

    def status(self, job_id: str) -> JobStatus | None:
        st = self.redis.hget(keys.job_hash(job_id), "status")
        return JobStatus(_s(st)) if st is not None else None

    def cancel(self, job_id: str) -> JobStatus | None:
        """Ask for a job to stop. A queued job is cancelled at once; a running one within one engine step.

        Returns the status the job had when asked (None if unknown); a final status means nothing changed.
        """
        st = self._cancel(
            keys=[keys.job_hash(job_id), keys.out_stream(job_id), keys.cancel_stream()],
            args=[job_id, _cancel_result(job_id), repr(time.time())],
        )
        return JobStatus(_s(st)) if st else None

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for the final result. Raises ``TimeoutError`` after ``timeout`` s, ``JobNotFound`` if unknown."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out_key = keys.out_stream(job_id)
        last = "0-0"
        while True:
            raw, st = self.redis.hmget(keys.job_hash(job_id), ["result", "status"])
            if raw is not None:
                return JobResult.model_validate_json(raw)
            if st is None:
                raise JobNotFound(job_id)
            block_ms = 1000
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"job {job_id} not finished after {timeout} s (status {_s(st)})")
                block_ms = max(1, min(block_ms, int(left * 1000)))
            if last == "0-0":  # no need to read the tokens themselves: start at the newest entry
                newest = self.redis.xrevrange(out_key, count=1)
                last = _s(newest[0][0]) if newest else "0-0"
            # Wake as soon as the worker writes anything to the job's stream; the end entry
            # and the result are written in one transaction (re-checked on the next turn).
            resp = self.redis.xread({out_key: last}, count=1000, block=block_ms)
            for _, entries in resp or []:
                if entries:
                    last = _s(entries[-1][0])

    def stream(self, job_id: str, from_index: int = 0, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Yield the job's token events in order, each token index once, until the job ends.

        Resumable: a subscriber that saw ``N`` tokens reconnects with ``from_index=N``
        (events entirely before N are skipped). ``timeout`` bounds the wait for the
        next event (``TimeoutError``).
        """
        out_key = keys.out_stream(job_id)
        dedup = EventDeduper(from_index)
        last = "0-0"
        idle_since = time.monotonic()
        while True:
            resp = self.redis.xread({out_key: last}, count=1000, block=1000)
            if not resp:
                if self._ended_without_stream(job_id):
                    return
                if timeout is not None and time.monotonic() - idle_since > timeout:
                    raise TimeoutError(f"no event for job {job_id} in {timeout} s")
                continue
            idle_since = time.monotonic()
            for _, entries in resp:
                for entry_id, fields in entries:
                    last = _s(entry_id)
                    ev = decode_out_entry(job_id, fields)
                    if isinstance(ev, str):
                        return
                    if dedup.accept(ev):
                        yield ev

    def _ended_without_stream(self, job_id: str) -> bool:
        st, exists = self.redis.hget(keys.job_hash(job_id), "status"), self.redis.exists(keys.out_stream(job_id))
        if st is None and not exists:
            raise JobNotFound(job_id)
        return st is not None and JobStatus(_s(st)).is_final and not exists


class AsyncProducer:
    """``Producer`` on redis.asyncio: same methods, awaitable; ``stream`` is an async iterator."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._submit = client.register_script(_SUBMIT_LUA)
        self._cancel = client.register_script(_CANCEL_LUA)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> AsyncProducer:
        return cls(aioredis.Redis.from_url(url, **kwargs))

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def submit(
        self,
        request: JobRequest | dict | None = None,
        *,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        job_id: str | None = None,
        **fields: Any,
    ) -> str:
        job = build_request(request, prompt=prompt, messages=messages, job_id=job_id, **fields)
        await self._submit(
            keys=[keys.job_hash(job.job_id), keys.jobs_stream(job.lane.value)],
            args=[job_fields(job)["job"], job.lane.value, repr(job.created_at), job.result_ttl_s],
        )
        return job.job_id

    async def submit_many(self, requests: Iterable[JobRequest | dict]) -> list[str]:
        jobs = [build_request(r) for r in requests]
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            await self._submit(
                keys=[keys.job_hash(job.job_id), keys.jobs_stream(job.lane.value)],
                args=[job_fields(job)["job"], job.lane.value, repr(job.created_at), job.result_ttl_s],
                client=pipe,
            )
        await pipe.execute()
        return [j.job_id for j in jobs]

    async def status(self, job_id: str) -> JobStatus | None:
        st = await self.redis.hget(keys.job_hash(job_id), "status")
        return JobStatus(_s(st)) if st is not None else None

    async def cancel(self, job_id: str) -> JobStatus | None:
        st = await self._cancel(
            keys=[keys.job_hash(job_id), keys.out_stream(job_id), keys.cancel_stream()],
            args=[job_id, _cancel_result(job_id), repr(time.time())],
        )
        return JobStatus(_s(st)) if st else None

    async def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        out_key = keys.out_stream(job_id)
        last = "0-0"
        while True:
            raw, st = await self.redis.hmget(keys.job_hash(job_id), ["result", "status"])
            if raw is not None:
                return JobResult.model_validate_json(raw)
            if st is None:
                raise JobNotFound(job_id)
            block_ms = 1000
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"job {job_id} not finished after {timeout} s (status {_s(st)})")
                block_ms = max(1, min(block_ms, int(left * 1000)))
            if last == "0-0":
                newest = await self.redis.xrevrange(out_key, count=1)
                last = _s(newest[0][0]) if newest else "0-0"
            resp = await self.redis.xread({out_key: last}, count=1000, block=block_ms)
            for _, entries in resp or []:
                if entries:
                    last = _s(entries[-1][0])

    async def stream(self, job_id: str, from_index: int = 0, timeout: float | None = None) -> AsyncIterator[TokenEvent]:
        out_key = keys.out_stream(job_id)
        dedup = EventDeduper(from_index)
        last = "0-0"
        idle_since = time.monotonic()
        while True:
            resp = await self.redis.xread({out_key: last}, count=1000, block=1000)
            if not resp:
                st = await self.redis.hget(keys.job_hash(job_id), "status")
                exists = await self.redis.exists(out_key)
                if st is None and not exists:
                    raise JobNotFound(job_id)
                if st is not None and JobStatus(_s(st)).is_final and not exists:
                    return
                if timeout is not None and time.monotonic() - idle_since > timeout:
                    raise asyncio.TimeoutError(f"no event for job {job_id} in {timeout} s")
                continue
            idle_since = time.monotonic()
            for _, entries in resp:
                for entry_id, fields in entries:
                    last = _s(entry_id)
                    ev = decode_out_entry(job_id, fields)
                    if isinstance(ev, str):
                        return
                    if dedup.accept(ev):
                        yield ev
