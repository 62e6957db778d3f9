"""The worker's second thread: what must happen on time whatever the loop is doing.

Every ``lease_ms / 3`` it resets the idle time of the entries the worker holds (and
reports those another consumer took over); it follows the cancel stream (a cancel
reaches the loop before its next step); it trims lanes by MINID and removes consumers
that hold nothing and have been idle for ``stale_consumer_ms``; it writes the
worker's engine stats hash for ``pagestream stats``. The loop itself only talks to
Redis when it pulls. Everything it shares with the loop goes through ``LoopState``.
"""
from __future__ import annotations

import logging
import threading
import time

import redis

from pagestream.producer.protocol import keys
from pagestream.worker.bulk_jobs import BulkJobs
from pagestream.worker.consumer import Consumer
from pagestream.worker.loop_state import LoopState
from pagestream.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class ControlThread(threading.Thread):
    def __init__(self, client: redis.Redis, settings: WorkerSettings, consumer: Consumer, state: LoopState, bulk: BulkJobs) -> None:
        super().__init__(name="pagestream-control", daemon=True)
        self.redis = client
        self.settings = settings
        self.consumer = consumer
        self.state = state
        self.bulk = bulk

    def run(self) -> None:
        state = self.state
        try:
            last_cancel = self.redis.xinfo_stream(keys.cancel_stream())["last-generated-id"]
        except redis.ResponseError:
            last_cancel = b"0-0"
        refresh_every = self.settings.lease_ms / 3000
        next_refresh = next_trim = next_stats = 0.0
        while not state.stopping.is_set():
            try:
                resp = self.redis.xread({keys.cancel_stream(): last_cancel}, count=1000, block=int(min(refresh_every, 0.5) * 1000))
                for _, entries in resp or []:
                    for entry_id, fields in entries:
                        last_cancel = entry_id
                        job_id = fields.get(b"job_id")
                        if job_id:
                            state.request_cancel(job_id.decode("utf-8", "replace"))
                now = time.monotonic()
                if now >= next_refresh:
                    next_refresh = now + refresh_every
                    with state.leases:
                        by_lane: dict[str, list[str]] = {}
                        for lane, eid in state.held() + list(self.bulk.pending()):
                            by_lane.setdefault(lane, []).append(eid)
                        lost = self.consumer.refresh_leases(by_lane)
                    if lost:
                        state.report_lost(lost)
                if now >= next_trim:
                    next_trim = now + self.settings.trim_interval_s
                    self.consumer.trim()
                    for name in self.consumer.remove_stale_consumers(self.settings.stale_consumer_ms):
                        log.info("removed stale consumer %s (no pending entries, idle)", name)
                if now >= next_stats:
                    next_stats = now + 1.0
                    snap = state.stats_snapshot
                    if snap:
                        wk = keys.worker_hash(self.settings.consumer)
                        pipe = self.redis.pipeline(transaction=False)
                        pipe.hset(wk, mapping={k: str(v) for k, v in snap.items()})
                        pipe.expire(wk, 15)
                        pipe.execute()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("control thread: redis unavailable (%s)", exc)
                state.stopping.wait(0.5)
            except Exception:
                log.exception("control thread error")
                state.stopping.wait(0.5)
