"""Which bulks a worker still runs jobs for.

A bulk that is cancelling, cancelled, expired or failed will never use more
results, so its queued jobs are acked without running (no dead letter: nothing
is wrong with them). ``BulkGate.is_live`` caches ``producer.protocol.bulk.is_live``
per bulk for ``ttl_s``, so a worker admitting thousands of a bulk's jobs asks
Redis about once a second, not once a job.

While a bulk is cancelling, its orchestrator waits for every submitted job to be
counted before it finalizes. ``record_skipped`` counts the skipped ones (once per
custom_id, through the bulk's done set) so that wait ends as soon as the jobs
that did run are durable, instead of after the cancel grace period.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import redis

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.bulk import SKIP_LUA, is_live

log = logging.getLogger(__name__)

#: how long one answer of ``bulk_is_live`` is trusted
LIVENESS_TTL_S = 1.5

class BulkGate:
    def __init__(self, client: redis.Redis, ttl_s: float = LIVENESS_TTL_S) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[bool, float]] = {}  # bulk_id -> (live, checked at, monotonic)
        self._skip = client.register_script(SKIP_LUA)
        self.num_checks = 0  # round trips to Redis (the cache's misses)

    def is_live(self, bulk_id: str) -> bool:
        """False once the bulk is cancelling or final; a Redis error counts as live (the sink drops late results)."""
        now = time.monotonic()
        hit = self._cache.get(bulk_id)
        if hit is not None and now - hit[1] < self.ttl_s:
            return hit[0]
        self.num_checks += 1
        try:
            live = is_live(self.redis, keys.bulk_hash(bulk_id))
        except redis.RedisError as exc:
            log.warning("could not check bulk %s (%s); running its jobs", bulk_id, exc)
            return True
        if len(self._cache) > 1024:
            self._cache = {b: v for b, v in self._cache.items() if now - v[1] < self.ttl_s}
        self._cache[bulk_id] = (live, now)
        return live

    def record_skipped(self, bulk_id: str, custom_ids: Iterable[str]) -> int:
        """Count skipped jobs of a cancelling bulk toward its done total; returns how many were new."""
        ids = list(custom_ids)
        if not ids:
            return 0
        return int(self._skip(keys=[keys.bulk_hash(bulk_id), keys.bulk_done_set(bulk_id)], args=ids))
