"""The worker's second thread: what must happen on time whatever the loop is doing.

Every ``lease_ms / 3`` it resets the idle time of the entries the worker holds (and
reports those another consumer took over); it follows the cancel stream (a cancel
reaches the loop before its next step); it trims lanes by MINID; it writes the
worker's engine stats hash for ``pagestream stats``. The loop itself only talks to
Redis when it pulls.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import redis

from pagestream.producer import keys

if TYPE_CHECKING:
    from pagestream.worker.worker import Worker

log = logging.getLogger(__name__)


class ControlThread(threading.Thread):
    def __init__(self, worker: Worker) -> None:
        super().__init__(name="pagestream-control", daemon=True)
        self.worker = worker

    def run(self) -> None:
        w = self.worker
        try:
            last_cancel = w.redis.xinfo_stream(keys.cancel_stream())["last-generated-id"]
        except redis.ResponseError:
            last_cancel = b"0-0"
        refresh_every = w.settings.lease_ms / 3000
        next_refresh = next_trim = next_stats = 0.0
        while not w._control_stop.is_set():
            try:
                resp = w.redis.xread({keys.cancel_stream(): last_cancel}, count=1000, block=int(min(refresh_every, 0.5) * 1000))
                for _, entries in resp or []:
                    for entry_id, fields in entries:
                        last_cancel = entry_id
                        job_id = fields.get(b"job_id")
                        if job_id:
                            with w._lock:
                                w._cancel_requests.add(job_id.decode("utf-8", "replace"))
                now = time.monotonic()
                if now >= next_refresh:
                    next_refresh = now + refresh_every
                    with w._lock:
                        held = list(w._held)
                    held += w.bulk.pending()
                    by_lane: dict[str, list[str]] = {}
                    for lane, eid in held:
                        by_lane.setdefault(lane, []).append(eid)
                    lost = w.consumer.refresh_leases(by_lane)
                    if lost:
                        with w._lock:
                            w._lost.update(lost)
                if now >= next_trim:
                    next_trim = now + w.settings.trim_interval_s
                    w.consumer.trim()
                if now >= next_stats:
                    next_stats = now + 1.0
                    snap = dict(w._stats_snapshot)
                    if snap:
                        wk = keys.worker_hash(w.name)
                        pipe = w.redis.pipeline(transaction=False)
                        pipe.hset(wk, mapping={k: str(v) for k, v in snap.items()})
                        pipe.expire(wk, 15)
                        pipe.execute()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("control thread: redis unavailable (%s)", exc)
                w._control_stop.wait(0.5)
            except Exception:
                log.exception("control thread error")
                w._control_stop.wait(0.5)
