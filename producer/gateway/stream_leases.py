"""Streams that outlive their client or their gateway (issue 22): a job streamed to a client is leased in
Redis (``keys.stream_leases``: job id -> when its lease ends, ms) by the gateway serving it, renewed while
the client is connected. A client that leaves has ``stream_resume_grace_s`` to reconnect to any gateway
with ``Last-Event-ID`` (``GET /v1/streams``), whose stream then renews the lease; every gateway reaps the
leases that ended and cancels their jobs (the worker aborts them within a step, freeing their KV blocks).
Because the lease lives in Redis and any gateway reaps it, the jobs of a gateway killed with kill -9 are
cancelled too, within the grace of its death, unless their clients resumed them elsewhere (a client that
leaves a live gateway has the whole grace; one whose gateway died, at least half of it).

With a grace of 0 a client that leaves has its job cancelled at once by its gateway; the lease then only
covers a gateway's death (``KILLED_GATEWAY_LEASE_S``)."""
from __future__ import annotations

import asyncio
import logging
import time

import redis

from pagestream.producer.protocol import keys

log = logging.getLogger(__name__)

#: with no resume grace: how long after a gateway's death its streams' jobs are cancelled
KILLED_GATEWAY_LEASE_S = 5.0
#: leases reaped per round
REAP_BATCH = 500

# KEYS: the leases. ARGV: now ms, how many. The ended leases, removed: whoever removes one cancels its job.
REAP_LUA = """
local ended = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #ended > 0 then redis.call('ZREM', KEYS[1], unpack(ended)) end
return ended
"""


def _ms() -> int:
    return int(time.time() * 1000)


class StreamLeases:
    """The leases of one gateway's streams, and the reaper of every gateway's ended ones."""

    def __init__(self, state) -> None:
        self.state = state
        self.redis = state.producer.redis
        self.grace_s = state.settings.stream_resume_grace_s
        self.lease_s = self.grace_s if self.grace_s > 0 else KILLED_GATEWAY_LEASE_S
        # while held, a lease runs 3/4 of that ahead, renewed every quarter, and ended leases are reaped every
        # eighth (0.5 s at most): a dead gateway's leases end 1/2 to 3/4 of the grace after its death and their
        # jobs are cancelled within the grace (its clients have at least half of it to come back elsewhere)
        self.held_ms = int(self.lease_s * 750)
        self.renew_s = self.lease_s / 4
        self.reap_interval_s = min(0.5, self.lease_s / 8)
        self._reap = self.redis.register_script(REAP_LUA)

    async def hold(self, job_ids: list[str]) -> None:
        """Keep the jobs leased while this stream's client is connected (until cancelled)."""
        key = keys.stream_leases()
        while True:
            try:
                await self.redis.zadd(key, {j: _ms() + self.held_ms for j in job_ids}, gt=True)
            except redis.RedisError:
                pass  # Redis away for a moment: the next renewal may land
            await asyncio.sleep(self.renew_s)

    async def ended(self, job_ids: list[str], finished: bool, failed: bool) -> None:
        """The stream ended: jobs finished (the leases go), failed or left with no grace (cancelled now), or
        left (a full grace from now to resume, then whichever gateway reaps the lease cancels them)."""
        key = keys.stream_leases()
        try:
            if finished or failed or self.grace_s <= 0:
                await self.redis.zrem(key, *job_ids)
                if not finished:
                    for j in job_ids:
                        before = await self.state.producer.cancel(j)
                        if not failed and before is not None and not before.is_final:
                            self.state.metrics.disconnect_cancels.inc()
            else:
                await self.redis.zadd(key, {j: _ms() + int(self.grace_s * 1000) for j in job_ids}, gt=True)
        except redis.RedisError as exc:
            log.warning("could not end the leases of %d streamed jobs: %s", len(job_ids), exc)

    async def reap_once(self) -> int:
        """Cancel the jobs whose lease ended (their clients left past the grace, or their gateway died)."""
        ended = await self._reap(keys=[keys.stream_leases()], args=[_ms(), REAP_BATCH])
        for raw in ended:
            job_id = raw.decode() if isinstance(raw, bytes) else raw
            before = await self.state.producer.cancel(job_id)  # a job already final: nothing happens
            if before is not None and not before.is_final:
                self.state.metrics.disconnect_cancels.inc()
        return len(ended)

    async def reap(self) -> None:
        """Reap ended leases until cancelled (every gateway runs this)."""
        interval = self.reap_interval_s
        while True:
            try:
                await self.reap_once()
            except redis.RedisError:
                pass  # the next round retries
            except Exception:
                log.exception("stream lease reaper")
            await asyncio.sleep(interval)
