"""The bulk sink: finished bulk jobs -> part files in the bulk's output, acked once durable.

The worker loop hands every final result of a job whose ``output.kind == "bulk"``
to ``add()`` instead of publishing it to Redis, and XACKs exactly what
``poll()`` (each iteration) and ``close()`` (on shutdown) return: the entries
whose line is in a part file that has been durably written. A worker that dies
before a flush loses nothing (its entries stay pending and are reclaimed); a
re-run may put a job's line into a second part, and finalize keeps one.

After a part is durable the sink counts its custom_ids once per bulk (SADD on
the bulk's done set, then HINCRBY completed/failed, in one Lua script), which is
what the orchestrator waits on. The same script writes the bulk's ``bulk_progress``
event when the part changed the counts (on Redis Cluster, where the events stream
is in another slot, the sink writes it just after): one per part, not per line.

Buffers flush at ``bulk_flush_lines`` or after ``bulk_flush_interval_s``; once
``bulk_max_buffered_lines`` (default 4 x ``bulk_flush_lines``) are buffered in
all, every buffer is due, and the worker pulls no new jobs until writes succeed
(failed writes are retried with backoff).
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from pydantic import ValidationError

from pagestream.producer.protocol import job as job_hash
from pagestream.producer.protocol import keys
from pagestream.producer.bulk.parts import TOOL_ANSWER, PartEntry, line_of_job_id, result_entry
from pagestream.producer.bulk.storage import StorageError, StorageSettings
from pagestream.producer.bulk.stores import Storage, open_storage, storage_settings_for
from pagestream.producer.protocol.bulk import (COUNT_LUA, BulkField, BulkSpec, BulkStatus, count_args, count_keys,
                                              progress_after_count)
from pagestream.producer.protocol.events import events_maxlen
from pagestream.producer.protocol.redis_conn import Backoff, is_cluster
from pagestream.producer.protocol.tools import ToolAnswer
from pagestream.producer.protocol.wire import as_str

log = logging.getLogger(__name__)

#: consecutive permanent write failures before the sink tells the orchestrator to fail the bulk
PERMANENT_FAILURES_TO_REPORT = 3
_MAX_BACKOFF_S = 30.0


@dataclass
class _Buffer:
    uri: str | None
    first_at: float
    items: list[tuple[str, str, PartEntry]] = field(default_factory=list)
    jobs: list[tuple[str, int]] = field(default_factory=list)  # (job_id, result_ttl_s) per item
    retry_at: float = 0.0
    backoff: Backoff = field(default_factory=lambda: Backoff(base=1.0, cap=_MAX_BACKOFF_S))  # 1, 2, 4 .. 30 s
    permanent_failures: int = 0


class BulkSink:
    """Buffers bulk results per bulk and flushes them as ``parts/<worker>-<seq>.jsonl``."""

    def __init__(self, redis_client: redis.Redis, consumer_name: str, settings: Any = None) -> None:
        self.redis = redis_client
        self.consumer = re.sub(r"[^A-Za-z0-9._-]", "_", consumer_name) or "worker"
        self.flush_lines = int(getattr(settings, "bulk_flush_lines", 256))
        self.flush_interval_s = float(getattr(settings, "bulk_flush_interval_s", 5.0))
        # over this many buffered lines every buffer is due (the worker has stopped pulling)
        self.max_buffered_lines = int(getattr(settings, "bulk_max_buffered_lines", None) or 4 * self.flush_lines)
        endpoint = getattr(settings, "s3_endpoint_url", None)
        self.storage_settings = StorageSettings(**({"s3_endpoint_url": endpoint} if endpoint else {}))
        self._specs: dict[str, BulkSpec] = {}
        self._count = redis_client.register_script(COUNT_LUA)
        self._cluster = is_cluster(redis_client)  # the events stream is in another slot than the bulk's keys
        self._buffers: dict[str, _Buffer] = {}
        self._storages: dict[str, Storage] = {}
        self._to_ack: list[tuple[str, str]] = []

    def __len__(self) -> int:
        return sum(len(b.items) for b in self._buffers.values())

    def add(self, lane: str, entry_id: str, job: Any, result: Any) -> None:
        """Buffer the final result of bulk job ``job`` (a ``JobRequest``) read from ``lane`` as ``entry_id``."""
        target = job.output
        status = getattr(result, "status", None)
        status = getattr(status, "value", status)
        error = getattr(result, "error", None)
        if error is None and status not in (None, "completed"):
            error = f"job ended as {status}"
        metadata = getattr(job, "metadata", None) or {}
        line = metadata.get("bulk_line")
        if line is None:
            try:
                line = line_of_job_id(job.job_id)
            except (IndexError, ValueError):
                line = 0  # a salvaged stub without its line: compaction keys on (line, custom_id)
        tools = None
        if error is None and metadata.get(TOOL_ANSWER) is not None:
            try:  # how the line's text is read as calls; one this worker cannot read is an error line, never text
                tools = ToolAnswer.model_validate(metadata[TOOL_ANSWER])
            except ValidationError as exc:
                error = f"the job's tool_choice cannot be answered by this worker: {exc.errors()[0]['msg']}"
        entry = result_entry(
            job_id=job.job_id,
            line=line,
            custom_id=target.custom_id or job.job_id,
            chat=getattr(job, "messages", None) is not None,
            result=result,
            requested_model=getattr(job, "model", None),
            error=error,
            tools=tools,
        )
        buf = self._buffers.get(target.bulk_id)
        if buf is None:
            buf = self._buffers[target.bulk_id] = _Buffer(uri=target.uri, first_at=time.monotonic())
        buf.items.append((lane, entry_id, entry))
        buf.jobs.append((job.job_id, int(getattr(job, "result_ttl_s", 0) or 3600)))

    def poll(self) -> list[tuple[str, str]]:
        """Flush buffers that are full or old enough; returns (lane, entry_id) pairs now safe to XACK."""
        return self._flush_due(force=False)

    def close(self) -> list[tuple[str, str]]:
        """Flush everything that can be flushed now; returns what to XACK (the rest stays pending)."""
        return self._flush_due(force=True)

    # ---- internals ----------------------------------------------------------------------------
    def _flush_due(self, force: bool) -> list[tuple[str, str]]:
        acks, self._to_ack = self._to_ack, []
        now = time.monotonic()
        pressed = len(self) >= self.max_buffered_lines
        for bulk_id, buf in list(self._buffers.items()):
            due = force or pressed or len(buf.items) >= self.flush_lines or now - buf.first_at >= self.flush_interval_s
            if due and (force or now >= buf.retry_at):
                acks.extend(self._flush(bulk_id, buf))
        return acks

    def _storage(self, bulk_id: str, uri: str | None) -> Storage:
        # The bulk's S3 endpoint, region and addressing style (given at submit) travel in its spec:
        # parts go where the orchestrator reads them, whatever this worker's environment says.
        spec = self._specs.get(bulk_id)
        if spec is None:
            raw = self.redis.hget(keys.bulk_hash(bulk_id), BulkField.SPEC)
            if raw is not None:
                spec = self._specs[bulk_id] = BulkSpec.model_validate_json(as_str(raw))
            elif uri is None:
                raise StorageError(f"bulk {bulk_id} has no output URI", permanent=True)
        uri = uri or spec.output
        settings = storage_settings_for(spec, self.storage_settings) if spec else self.storage_settings
        st = self._storages.get(uri)  # an output URI belongs to one bulk, so to one S3 location
        if st is None:
            st = self._storages[uri] = open_storage(uri, settings)
        return st

    def _let_go(self, bulk_id: str, entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
        del self._buffers[bulk_id]
        self._specs.pop(bulk_id, None)
        return entries

    def _is_final(self, key: str) -> bool:
        status = self.redis.hget(key, BulkField.STATUS)
        return status is None or BulkStatus(as_str(status)).is_final

    def _flush(self, bulk_id: str, buf: _Buffer) -> list[tuple[str, str]]:
        key = keys.bulk_hash(bulk_id)
        entries = [(lane, entry_id) for lane, entry_id, _ in buf.items]
        status, frozen = self.redis.hmget(key, [BulkField.STATUS, BulkField.FINALIZE_PARTS])
        if status is None or BulkStatus(as_str(status)).is_final or frozen is not None:
            # The bulk is over, gone, or finalizing with its part list frozen: nobody will compact
            # this part (its lines are redeliveries, or were cut by a cancel), so let the jobs go.
            return self._let_go(bulk_id, entries)
        seq = self.redis.incr(keys.bulk_part_seq(bulk_id))
        name = f"parts/{self.consumer}-{seq:06d}.jsonl"
        data = b"".join(entry.dumps() for _, _, entry in buf.items)
        try:
            self._storage(bulk_id, buf.uri).put_bytes(name, data)
        except (StorageError, OSError) as exc:
            permanent = getattr(exc, "permanent", False)
            buf.permanent_failures = buf.permanent_failures + 1 if permanent else 0
            buf.retry_at = time.monotonic() + buf.backoff.next()
            log.warning("bulk %s: part write failed (%d in a row), will retry: %s", bulk_id, buf.backoff.failures, exc)
            fields = {BulkField.SINK_ERROR: f"{self.consumer}: {exc}"}
            if buf.permanent_failures >= PERMANENT_FAILURES_TO_REPORT:
                fields[BulkField.SINK_ERROR_PERMANENT] = "1"
            self.redis.hset(key, mapping=fields)
            return []
        if self._is_final(key):
            # Finalize ran between the check above and the write (it removes the parts it knew of
            # after the manifest): this part is a late duplicate nobody reads, so take it back.
            try:
                self._storage(bulk_id, buf.uri).delete_many([name])
            except (StorageError, OSError):
                log.warning("bulk %s: could not remove late part %s", bulk_id, name, exc_info=True)
            return self._let_go(bulk_id, entries)
        if buf.backoff.failures:  # this worker's last error is history now
            self.redis.hdel(key, BulkField.SINK_ERROR, BulkField.SINK_ERROR_PERMANENT)
        spec = self._specs.get(bulk_id)
        batch = spec.batch_id if spec is not None else None
        lines = [(entry.custom_id or "", entry.ok) for _, _, entry in buf.items]
        now = time.time()
        counted = self._count(keys=count_keys(bulk_id, self._cluster),
                              args=count_args(now, events_maxlen(), bulk_id, batch, lines=lines))
        progress_after_count(self.redis, self._cluster, counted, bulk_id, now, batch)
        # The submit left a job hash per bulk job; mark it final and let it expire like any result.
        pipe = self.redis.pipeline(transaction=False)
        for (job_id, ttl), (_, _, entry) in zip(buf.jobs, buf.items):
            jh = keys.job_hash(job_id)
            job_hash.queue_bulk_done(pipe, jh, entry.ok, bulk_id)
            pipe.expire(jh, ttl)
        pipe.execute()
        del self._buffers[bulk_id]
        return entries
