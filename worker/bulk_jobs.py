"""A worker's bulk jobs: the loop's side of the bulk path.

- Before a bulk job is admitted, ``is_live`` asks ``worker.bulk_gate`` whether its
  bulk still wants results; ``skip`` turns one that does not into a cancelled
  result that is acked without running (no dead letter).
- A finished bulk job goes to the bulk sink (``to_sink``) instead of Redis. Its
  entry stays pending (its lease kept alive by the control thread) until the
  sink says its part is durable (``poll`` / ``close``), then it is acked.
- Backpressure: while ``bulk_buffer_limit`` entries wait on the sink, ``full``
  is true and the worker pulls nothing new (it keeps stepping and flushing).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from pagestream.producer.protocol.schema import JobRequest, JobResult, JobStatus
from pagestream.worker.bulk_gate import BulkGate
from pagestream.worker.consumer import Delivery
from pagestream.worker.jobs import ActiveJob
from pagestream.worker.publisher import Final
from pagestream.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

Entry = tuple[str, str]  # (lane, entry_id)


class BulkJobs:
    def __init__(self, client: redis.Redis, settings: WorkerSettings, sink: Any = None) -> None:
        self.redis = client
        self.settings = settings
        self.sink = sink  # a worker.bulk_sink.BulkSink, made on first use
        self.error: str | None = None  # why this worker cannot write bulk output, if it cannot
        self.gate = BulkGate(client)
        self.backpressure = False
        self._next_warning = 0.0
        self._lock = threading.Lock()  # the publisher thread acks, the control thread refreshes leases
        self._pending: set[Entry] = set()  # handed to the sink, not acked yet

    # -- skipping jobs of bulks that are over ----------------------------------------------------

    def is_live(self, job: JobRequest) -> bool:
        return self.gate.is_live(job.output.bulk_id)

    def skip(self, a: ActiveJob, worker: str) -> Final:
        """A job whose bulk is no longer live: a cancelled result, acked; the job hash (if any) says so."""
        result = JobResult(
            job_id=a.job_id,
            status=JobStatus.CANCELLED,
            error=f"not run: bulk {a.job.output.bulk_id} is cancelled, expired or failed",
            worker=worker,
            deliveries=a.delivery.deliveries,
            created_at=a.job.created_at,
            metadata=a.job.metadata,
        )
        return Final(result, a.job.result_ttl_s, (a.delivery.lane, a.delivery.entry_id), write_result=a.has_job_hash)

    def record_skipped(self, skipped: list[ActiveJob]) -> None:
        """Count skipped jobs toward their bulk's done total, so a cancelling bulk finalizes at once."""
        by_bulk: dict[str, list[str]] = {}
        for a in skipped:
            by_bulk.setdefault(a.job.output.bulk_id, []).append(a.job.output.custom_id or a.job_id)
        for bulk_id, custom_ids in by_bulk.items():
            try:
                self.gate.record_skipped(bulk_id, custom_ids)
            except redis.RedisError as exc:  # the orchestrator then waits out its cancel grace period
                log.warning("could not count %d skipped jobs of bulk %s: %s", len(custom_ids), bulk_id, exc)

    # -- the sink -------------------------------------------------------------------------------

    def _get_sink(self) -> Any:
        if self.sink is None and self.error is None:
            try:
                from pagestream.worker.bulk_sink import BulkSink
            except ImportError as exc:
                self.error = f"bulk output is not available in this worker (worker.bulk_sink: {exc})"
                return None
            self.sink = BulkSink(self.redis, self.settings.consumer, self.settings)
        return self.sink

    def to_sink(self, d: Delivery, job: JobRequest, result: JobResult) -> bool:
        """Hand a final result to the sink; False if this worker has none (``error`` says why)."""
        sink = self._get_sink()
        if sink is None:
            return False
        sink.add(d.lane, d.entry_id, job, result)
        with self._lock:
            self._pending.add((d.lane, d.entry_id))
        return True

    def poll(self) -> list[Entry]:
        """Entries whose part is now durable: safe to ack."""
        return self.sink.poll() if self.sink is not None else []

    def close(self) -> list[Entry]:
        """Flush what can be flushed now (the rest stays pending for a re-run); returns what to ack."""
        if self.sink is None:
            return []
        try:
            return self.sink.close()
        finally:
            self.sink = None

    def on_acked(self, pairs: list[Entry]) -> None:
        with self._lock:
            self._pending.difference_update(pairs)

    def pending(self) -> set[Entry]:
        """Entries waiting on the sink (their leases must be kept alive)."""
        with self._lock:
            return set(self._pending)

    def full(self) -> bool:
        """Backpressure: too many results wait for a durable part to take more work."""
        with self._lock:
            n = len(self._pending)
        full = n >= self.settings.bulk_buffer_limit
        if full and not self.backpressure and time.monotonic() >= self._next_warning:
            # slow part writes can make this flap at the limit: say it at most once a minute
            self._next_warning = time.monotonic() + 60.0
            log.warning("bulk sink holds %d results not yet durable (limit %d): pulling paused until parts are written",
                        n, self.settings.bulk_buffer_limit)
        self.backpressure = full
        return full
