"""Publishing off the engine's critical path.

The loop hands each step's writes to ``Publisher.put`` (a list append under a
lock, microseconds); a thread flushes them at most every ``interval_s``,
coalescing each (job, sample)'s consecutive deltas into one event whose token
index is that of its first token. One flush is one MULTI/EXEC transaction:
token events, then start markers, final results + status hashes + TTLs, end
events, XACKs and dead letters, so a job's last tokens, its result and its ack
become visible together or not at all.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from pagestream.producer import keys
from pagestream.producer.schema import JobResult
from pagestream.producer.wire import end_fields, token_event_fields
from pagestream.worker.consumer import Consumer, Delivery

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Delta:
    job_id: str
    sample: int
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclass(slots=True)
class Start:
    job_id: str
    worker: str
    started_at: float
    deliveries: int
    result_ttl_s: int = 24 * 3600


@dataclass(slots=True)
class Final:
    """The job's result; ``entry`` is acked unless None (bulk jobs are acked by their sink)."""

    result: JobResult
    result_ttl_s: int
    entry: tuple[str, str] | None
    dead_letter: Delivery | None = None  # also copy the raw entry to the DLQ (acked there)
    write_result: bool = True  # False: the job has no job hash/out stream to write (bulk)


@dataclass(slots=True)
class Ack:
    lane: str
    entry_ids: list[str]


@dataclass(slots=True)
class _Batch:
    deltas: list[Delta] = field(default_factory=list)
    ops: list[object] = field(default_factory=list)


class Publisher:
    def __init__(
        self,
        client: redis.Redis,
        consumer: Consumer,
        interval_s: float = 0.02,
        on_acked: Callable[[list[tuple[str, str]]], None] | None = None,
    ) -> None:
        self.redis = client
        self.consumer = consumer
        self.interval_s = interval_s
        self.on_acked = on_acked
        self._items: list[object] = []
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self._urgent = False
        self._thread = threading.Thread(target=self._run, name="pagestream-publisher", daemon=True)
        self.num_flushes = 0
        self.num_events = 0
        self.last_error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def put(self, items: list[object]) -> None:
        """Queue one step's writes (in order). Never blocks on Redis.

        Token deltas wait up to ``interval_s`` to be coalesced; a job's first token and
        anything else (results, acks, start markers) make the next flush go out at once,
        so time to first token and PEL slots are not held back by coalescing.
        """
        if not items:
            return
        urgent = any(not isinstance(i, Delta) or i.index == 0 for i in items)
        with self._cond:
            self._items.extend(items)
            if urgent:
                self._urgent = True
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._items) + (1 if self._busy else 0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written. False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._cond.notify_all()
            while self._items or self._busy:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.05 if left is None else min(0.05, left))
        return True

    def stop(self, timeout: float | None = 10.0) -> bool:
        ok = self.flush(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        return ok

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        last_flush = 0.0
        backoff = 0.05
        batch: list[object] = []
        while True:
            with self._cond:
                while not self._items and not self._stop and not batch:
                    self._cond.wait()
                if self._stop and not self._items and not batch:
                    return
                # Let deltas pile up for at most interval_s since the previous flush, unless
                # something urgent (a final result: its ack frees a PEL slot) is waiting.
                while not self._stop and not self._urgent:
                    wait = last_flush + self.interval_s - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                batch.extend(self._items)
                self._items.clear()
                self._urgent = False
                self._busy = True
            try:
                acked = self._write(batch)
                batch = []
                backoff = 0.05
                last_flush = time.monotonic()
                self.num_flushes += 1
                if acked and self.on_acked:
                    self.on_acked(acked)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Keep the batch and retry: a replayed event is dropped by subscribers by its index.
                self.last_error = exc
                log.warning("publisher: redis unavailable (%s), retrying in %.2fs", exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception as exc:  # a bug must not wedge the loop forever: drop and report
                self.last_error = exc
                log.exception("publisher: dropping a batch of %d writes", len(batch))
                batch = []
            finally:
                with self._cond:
                    self._busy = bool(batch)
                    self._cond.notify_all()

    def _write(self, items: list[object]) -> list[tuple[str, str]]:
        b = _coalesce(items)
        pipe = self.redis.pipeline(transaction=True)
        n_events = 0
        for d in b.deltas:
            pipe.xadd(keys.out_stream(d.job_id), token_event_fields(d.sample, d.index, d.token_ids, d.text, d.finish_reason))
            n_events += 1
        acked: list[tuple[str, str]] = []
        now_s = int(time.time())
        for op in b.ops:
            if isinstance(op, Start):
                jh = keys.job_hash(op.job_id)
                pipe.hset(jh, mapping={"status": "running", "worker": op.worker, "started_at": repr(op.started_at), "deliveries": op.deliveries})
                # a job that never finishes (every worker dies, nobody reclaims) does not leak its keys
                pipe.expire(jh, op.result_ttl_s)
            elif isinstance(op, Final):
                r = op.result
                if op.write_result:
                    jh, out = keys.job_hash(r.job_id), keys.out_stream(r.job_id)
                    pipe.hset(jh, mapping={"status": r.status.value, "result": r.model_dump_json(), "finished_at": repr(r.finished_at)})
                    pipe.xadd(out, end_fields(r.status.value))
                    pipe.expire(jh, op.result_ttl_s)
                    pipe.expire(out, op.result_ttl_s)
                if op.dead_letter is not None:
                    self.consumer.dead_letter(op.dead_letter, r.error or r.status.value, r.job_id, pipeline=pipe)
                    acked.append((op.dead_letter.lane, op.dead_letter.entry_id))
                elif op.entry is not None:
                    self.consumer.ack(op.entry[0], [op.entry[1]], pipeline=pipe)
                    acked.append(op.entry)
                if op.entry is not None:
                    ctr = keys.done_counter(op.entry[0], now_s)
                    pipe.incr(ctr)
                    pipe.expire(ctr, 120)
            elif isinstance(op, Ack) and op.entry_ids:
                self.consumer.ack(op.lane, op.entry_ids, pipeline=pipe)
                acked.extend((op.lane, e) for e in op.entry_ids)
        pipe.execute()
        self.num_events += n_events
        return acked


def _coalesce(items: list[object]) -> _Batch:
    b = _Batch()
    open_delta: dict[tuple[str, int], Delta] = {}  # the last delta of each (job, sample), still extendable
    for it in items:
        if it is None:
            continue
        if isinstance(it, Delta):
            key = (it.job_id, it.sample)
            cur = open_delta.get(key)
            if cur is not None and cur.finish_reason is None and cur.index + len(cur.token_ids) == it.index:
                cur.token_ids.extend(it.token_ids)
                cur.text += it.text
                cur.finish_reason = it.finish_reason
            else:
                cur = Delta(it.job_id, it.sample, it.index, list(it.token_ids), it.text, it.finish_reason)
                b.deltas.append(cur)
                open_delta[key] = cur
        else:
            b.ops.append(it)
    return b
