"""Per-tenant limits at the gateway: admit a request's jobs, stream or batch against its tenant's limits
(``producer.protocol.tenant_limits``, which says how they are counted), or answer 429 before anything is
queued; release what ends; sweep what ended unseen."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import redis

from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.bulk import BulkField, BulkStatus
from pagestream.producer.protocol.job import JobField, status_of
from pagestream.producer.protocol.schema import JobRequest
from pagestream.producer.protocol.tenant_limits import (BULKS, JOBS, SCRIPTS, STREAM_LEASE_MS, STREAMS, SUBMIT_GRACE_MS,
                                                         TOKENS, LimitTable, TenantLimits, job_tokens)
from pagestream.producer.protocol.wire import as_str

#: what each limit is called in a 429's message, and OpenAI's ``type`` for it
_WHAT = {JOBS: ("queued jobs", "requests"), TOKENS: ("queued tokens", "tokens"),
         STREAMS: ("concurrent streams", "requests"), BULKS: ("open batches", "requests")}


#: how often one gateway sweeps one tenant's open jobs (or batches) at most
SWEEP_INTERVAL_S = 0.5


def _ms() -> int:
    return int(time.time() * 1000)


def rate_limited(tenant: str, limit: str, allowed: int, in_use: int, limits: TenantLimits) -> GatewayError:
    what, kind = _WHAT[limit]
    return GatewayError(429, f"Rate limit reached for tenant '{tenant}' on {what}: limit {allowed}, in use {in_use}; "
                        f"retry after {limits.retry_after_s} s", type=kind, code="rate_limit_exceeded",
                        retry_after_s=limits.retry_after_s)


@dataclass(slots=True)
class StreamSlot:
    """One open stream's place under its tenant's ``max_concurrent_streams`` (a lease its stream renews)."""

    tenant: str
    member: str


class TenantAdmission:
    """The gateway's side of the per-tenant limits, over its Redis client."""

    def __init__(self, redis, table: LimitTable) -> None:
        self.redis = redis
        self.table = table
        self._scripts = {name: redis.register_script(src) for name, src in SCRIPTS.items()}
        self._swept: dict[tuple[str, str], float] = {}  # (tenant, what) -> when this gateway last swept it

    # -- jobs and streams -----------------------------------------------------------------------

    async def admit(self, tenant: str, jobs: list[JobRequest], context_len: int | None,
                    stream: bool) -> StreamSlot | None:
        """Count ``jobs`` (and a stream) against the tenant's limits, all or nothing; 429 past one (after a
        sweep of what ended unseen), 400 for a request no wait would admit. The stream's slot, if counted."""
        lim = self.table.of(tenant)
        count_jobs = lim.max_queued_jobs is not None or lim.max_queued_tokens is not None
        count_stream = stream and lim.max_concurrent_streams is not None
        if not count_jobs and not count_stream:
            return None
        pairs: list[str | int] = []
        if count_jobs:
            tokens = [job_tokens(j, context_len) for j in jobs]
            if lim.max_queued_jobs is not None and len(jobs) > lim.max_queued_jobs:
                raise GatewayError(400, f"the request has {len(jobs)} prompts; tenant '{tenant}' may queue at most "
                                   f"{lim.max_queued_jobs} jobs", param="prompt", code="request_too_large")
            if lim.max_queued_tokens is not None and sum(tokens) > lim.max_queued_tokens:
                raise GatewayError(400, f"the request counts {sum(tokens)} tokens (prompt + max_tokens x n); tenant "
                                   f"'{tenant}' may queue at most {lim.max_queued_tokens}", param="max_tokens",
                                   code="request_too_large")
            for j, t in zip(jobs, tokens):
                pairs += [j.job_id, t]
        member = uuid.uuid4().hex if count_stream else ""
        for attempt in (0, 1):
            now = _ms()
            limit, in_use = await self._scripts["admit"](
                keys=[keys.tenant_open_jobs(tenant), keys.tenant_job_tokens(tenant), keys.tenant_open_streams(tenant)],
                args=[now, _arg(lim.max_queued_jobs), _arg(lim.max_queued_tokens), _arg(lim.max_concurrent_streams),
                      member, now + STREAM_LEASE_MS, *pairs])
            limit = as_str(limit)
            if not limit:
                return StreamSlot(tenant, member) if member else None
            swept = attempt == 0 and limit in (JOBS, TOKENS) and self._may_sweep(tenant, "jobs")
            if swept and await self.sweep_jobs(tenant):
                continue  # some had ended unseen: try again
            raise rate_limited(tenant, limit, getattr(lim, limit), int(in_use), lim)
        raise AssertionError("unreachable")

    def _may_sweep(self, tenant: str, what: str) -> bool:
        """A sweep reads every open job of the tenant: at most one every ``SWEEP_INTERVAL_S`` per tenant, so a
        tenant retrying at its limit costs Redis little (jobs this gateway saw end were released at once)."""
        now = time.monotonic()
        if now - self._swept.get((tenant, what), float("-inf")) < SWEEP_INTERVAL_S:
            return False
        if len(self._swept) > 10_000:
            self._swept.clear()  # bounded: tenants come and go
        self._swept[(tenant, what)] = now
        return True

    async def release(self, tenant: str, job_ids: list[str]) -> None:
        """These jobs are final (or gone): they stop counting (a job released already is skipped)."""
        lim = self.table.of(tenant)
        if job_ids and (lim.max_queued_jobs is not None or lim.max_queued_tokens is not None):
            try:
                await self._scripts["release_jobs"](keys=[keys.tenant_open_jobs(tenant), keys.tenant_job_tokens(tenant)],
                                                    args=job_ids)
            except redis.RedisError:
                pass  # they stay counted until a sweep finds them final: an answer is never failed for this

    async def sweep_jobs(self, tenant: str) -> int:
        """Release the tenant's jobs whose hash says final, or that have no hash (expired, lost) and were
        admitted longer ago than a submit takes. How many were released."""
        ended = await self._ended(keys.tenant_open_jobs(tenant), keys.job_hash, JobField.STATUS,
                                  lambda st: status_of(st).is_final)
        if not ended:
            return 0
        return await self._scripts["release_jobs"](keys=[keys.tenant_open_jobs(tenant), keys.tenant_job_tokens(tenant)],
                                                   args=ended)

    async def hold_stream(self, slot: StreamSlot) -> None:
        """Renew the stream's lease until cancelled, then drop it (the stream ended)."""
        key = keys.tenant_open_streams(slot.tenant)
        try:
            while True:
                await asyncio.sleep(STREAM_LEASE_MS / 3000)
                try:
                    await self.redis.zadd(key, {slot.member: _ms() + STREAM_LEASE_MS}, xx=True)
                except redis.RedisError:
                    pass  # Redis away for a moment: the next renewal may land; the lease has slack
        finally:
            try:
                await self.redis.zrem(key, slot.member)
            except redis.RedisError:
                pass  # the lease runs out by itself

    async def drop_stream(self, slot: StreamSlot) -> None:
        """A stream counted but never opened (its submit failed)."""
        await self.redis.zrem(keys.tenant_open_streams(slot.tenant), slot.member)

    # -- batches --------------------------------------------------------------------------------

    async def admit_bulk(self, tenant: str, bulk_id: str) -> bool:
        """Count a batch about to be created against ``max_open_batches``; 429 past it (after a sweep).
        Whether it was counted (release it if its creation fails)."""
        lim = self.table.of(tenant)
        if lim.max_open_batches is None:
            return False
        for attempt in (0, 1):
            limit, in_use = await self._scripts["admit_bulk"](keys=[keys.tenant_open_bulks(tenant)],
                                                              args=[_ms(), lim.max_open_batches, bulk_id])
            if not as_str(limit):
                return True
            if attempt == 0 and self._may_sweep(tenant, "bulks") and await self.sweep_bulks(tenant):
                continue
            raise rate_limited(tenant, BULKS, lim.max_open_batches, int(in_use), lim)
        raise AssertionError("unreachable")

    async def release_bulk(self, tenant: str, bulk_id: str) -> None:
        await self.redis.zrem(keys.tenant_open_bulks(tenant), bulk_id)

    async def sweep_bulks(self, tenant: str) -> int:
        """Release the tenant's batches whose status is final, or whose hash is gone (expired)."""
        key = keys.tenant_open_bulks(tenant)
        ended = await self._ended(key, keys.bulk_hash, BulkField.STATUS, _bulk_final)
        return await self.redis.zrem(key, *ended) if ended else 0

    async def _ended(self, key: str, hash_of, field: str, is_final) -> list[str]:
        """The members of the admission set ``key`` whose hash's ``field`` says final, or whose hash is gone
        (expired, lost) and that were admitted longer ago than a submit takes."""
        members = await self.redis.zrange(key, 0, -1, withscores=True)
        if not members:
            return []
        ids = [as_str(m) for m, _ in members]
        pipe = self.redis.pipeline(transaction=False)
        for m in ids:
            pipe.hget(hash_of(m), field)
        statuses = await pipe.execute()
        old = _ms() - SUBMIT_GRACE_MS
        return [m for m, (_, admitted), st in zip(ids, members, statuses)
                if (st is None and admitted < old) or (st is not None and is_final(st))]


def _arg(limit: int | None) -> int:
    return -1 if limit is None else limit


def _bulk_final(raw) -> bool:
    try:
        return BulkStatus(as_str(raw)).is_final
    except ValueError:
        return False
