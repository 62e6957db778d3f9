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
from collections import Counter

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
    """The leases of one gateway's streams, and the reaper of every gateway's ended ones.

    One loop per gateway does the Redis work of every stream it serves: each round it reaps ended leases,
    every ``renew_s`` it renews all the leases its connected clients hold in one ZADD, and it drops the
    leases of finished streams in one ZREM. A stream's own Redis work is the first lease, written with the
    stream's record in one round trip (``lease_args``), and a prompt cancel when its client leaves."""

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
        self._held: Counter[str] = Counter()  # job id -> this gateway's open streams of it
        self._finished: set[str] = set()  # leases to drop at the next round

    def lease_args(self, job_ids: list[str]) -> tuple[str, dict[str, int]]:
        """``ZADD key GT mapping`` for the first lease of a stream's jobs (the caller pipelines it)."""
        return keys.stream_leases(), {j: _ms() + self.held_ms for j in job_ids}

    def hold(self, job_ids: list[str]) -> None:
        """This gateway's client is connected to a stream of these jobs: renew their leases until ``finish`` or ``left``."""
        self._held.update(job_ids)
        self._finished.difference_update(job_ids)

    def _unhold(self, job_ids: list[str]) -> None:
        self._held.subtract(job_ids)
        for j in job_ids:
            if self._held[j] <= 0:
                del self._held[j]

    def finish(self, job_ids: list[str]) -> None:
        """A held stream's jobs finished: their leases go at the next round (unless another stream holds them)."""
        self._unhold(job_ids)
        self._finished.update(j for j in job_ids if j not in self._held)

    async def left(self, job_ids: list[str], failed: bool, held: bool = True) -> None:
        """A stream ended unfinished: failed, or its client left with no grace (the jobs are cancelled now),
        or its client left (a full grace from now to resume, then whichever gateway reaps the lease cancels
        them). ``held``: the stream had called ``hold``."""
        if held:
            self._unhold(job_ids)
        key = keys.stream_leases()
        try:
            if failed or self.grace_s <= 0:
                await self.redis.zrem(key, *job_ids)
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

    async def drop_finished(self) -> None:
        """The finished streams' leases, dropped in one command."""
        if self._finished:
            done, self._finished = list(self._finished), set()
            await self.redis.zrem(keys.stream_leases(), *done)

    async def renew_once(self) -> None:
        """Every lease this gateway's connected clients hold, pushed ``held_ms`` ahead in one command (and
        the finished streams' dropped)."""
        await self.drop_finished()
        if self._held:
            await self.redis.zadd(keys.stream_leases(), dict.fromkeys(self._held, _ms() + self.held_ms), gt=True)

    async def reap(self) -> None:
        """Reap ended leases, renew held ones and drop finished ones until cancelled (every gateway runs this)."""
        next_renew = 0.0
        while True:
            try:
                if time.monotonic() >= next_renew:
                    next_renew = time.monotonic() + self.renew_s
                    await self.renew_once()
                else:
                    await self.drop_finished()
                await self.reap_once()
            except redis.RedisError:
                pass  # the next round retries
            except Exception:
                log.exception("stream lease reaper")
            await asyncio.sleep(self.reap_interval_s)
