"""Publishing off the engine's critical path.

The loop hands each step's writes to ``Publisher.put`` (a list append under a
lock, microseconds); a thread flushes them at most every ``interval_s``,
coalescing each (job, sample)'s consecutive deltas into one event whose token
index is that of its first token. One flush is one MULTI/EXEC transaction:
token events, then start markers, final results + status hashes + TTLs, end
events, XACKs and dead letters, so a job's last tokens, its result and its ack
become visible together or not at all. A job's first token entry (index 0) takes
its ``first_token`` firehose event into the same flush (after the job's ``started``
event, before its final one). On Redis Cluster a flush is one atomic script per
hash slot, then the acks (``worker.slot_batch``): a job's tokens, result and end entry stay
together, and its ack follows them.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from pagestream.producer.protocol import job as job_hash
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.events import (EventType, event_fields, events_maxlen, final_event_fields,
                                                 first_token_fields, queue_event, reclaimed_fields, resumed_fields)
from pagestream.producer.protocol.redis_conn import Backoff, is_cluster
from pagestream.producer.protocol.schema import JobResult, JobStatus
from pagestream.producer.protocol.wire import end_fields, token_event_fields
from pagestream.worker.consumer import Consumer, Delivery
from pagestream.worker.slot_batch import SlotBatch

log = logging.getLogger(__name__)

#: job_id of the result of an entry that names no job (written nowhere but the DLQ)
UNKNOWN_JOB_ID = "?"
#: the longest TTL the worker sets on a job's keys (a raw entry can ask for any)
MAX_KEY_TTL_S = 366 * 24 * 3600


@dataclass(slots=True)
class Delta:
    job_id: str
    sample: int
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[list] | None = None  # TokenLogprob wire form, one per token id (jobs that asked only)
    prompt_logprobs: list[list] | None = None  # the same per prompt token: a job's first delta (stream_prompt_logprobs)
    prompt_tokens: int | None = None  # the prompt's size, on a job's first delta
    prompt_token_ids: list[int] | None = None  # on a job's first delta too, for a job with return_prompt_token_ids
    at: float | None = None  # a sample's first delta (index 0): when the engine handed its first token over


@dataclass(slots=True)
class _Flush:
    """One flush's pipeline, and what it gathers to write once at its end: one XACK per lane,
    one INCRBY per done counter, and the entries it settles (for ``on_acked``)."""

    pipe: Any
    now_s: int
    acked: list[tuple[str, str]] = field(default_factory=list)
    to_ack: dict[str, list[str]] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)
    first_tokens: dict[str, dict[str, str]] = field(default_factory=dict)  # job_id -> its first_token event, to queue
    settled: list[str] = field(default_factory=list)  # jobs whose first_token is written (or due no more) once this lands

    def ack(self, lane: str, entry_ids: list[str]) -> None:
        self.to_ack.setdefault(lane, []).extend(entry_ids)
        self.acked.extend((lane, e) for e in entry_ids)


@dataclass(slots=True)
class Start:
    job_id: str
    worker: str
    started_at: float
    deliveries: int
    result_ttl_s: int = 24 * 3600
    created_at: float | None = None  # when the job was submitted: ``first_token``'s ttft counts from it (else from start)
    model: str | None = None  # the model the worker serves, on the ``first_token`` event
    first_token: bool = True  # False: an earlier delivery published tokens already (a resumed job), no first_token
    # the delivery took the job over (``Delivery.claimed_from``): a ``reclaimed`` event before ``started``; "" unknown
    reclaimed_from: str | None = None
    resumed_from: int = 0  # tokens an earlier delivery published that this one continues from: a ``resumed`` event

    def prepare(self, pub: Publisher) -> None:
        # before the deltas: a job's first delta may be in this batch, and its out stream gets this TTL
        pub._out_ttl[self.job_id] = _ttl(self.result_ttl_s)
        if self.first_token:
            since = self.created_at if self.created_at is not None else self.started_at
            pub._first_token[self.job_id] = (since, self.worker, self.model)
        else:
            pub._first_token.pop(self.job_id, None)

    def write(self, pub: Publisher, f: _Flush) -> None:
        jh = keys.job_hash(self.job_id)
        job_hash.queue_start(f.pipe, jh, self.worker, self.started_at, self.deliveries)
        # a job that never finishes (every worker dies, nobody reclaims) does not leak its keys
        f.pipe.expire(jh, _ttl(self.result_ttl_s))
        f.pipe.expire(keys.out_stream(self.job_id), _ttl(self.result_ttl_s))  # a resumed job's stream exists already
        if self.reclaimed_from is not None:
            queue_event(f.pipe, reclaimed_fields(self.job_id, self.started_at, self.worker, self.reclaimed_from,
                                                 self.deliveries), pub.events_maxlen)
        queue_event(f.pipe, event_fields(EventType.STARTED, self.job_id, self.started_at, worker=self.worker,
                                         deliveries=self.deliveries), pub.events_maxlen)
        if self.resumed_from:
            queue_event(f.pipe, resumed_fields(self.job_id, self.started_at, self.worker, self.resumed_from),
                        pub.events_maxlen)
        first = f.first_tokens.pop(self.job_id, None)  # its first token is in this flush too: after ``started``
        if first is not None:
            queue_event(f.pipe, first, pub.events_maxlen)


@dataclass(slots=True)
class Final:
    """The job's result; ``entry`` is acked unless None (bulk jobs are acked by their sink)."""

    result: JobResult
    result_ttl_s: int
    entry: tuple[str, str] | None
    dead_letter: Delivery | None = None  # also copy the raw entry to the DLQ (acked there)
    write_result: bool = True  # False: the job has no job hash/out stream to write (bulk)

    def prepare(self, pub: Publisher) -> None:
        pass

    def write(self, pub: Publisher, f: _Flush) -> None:
        r, result_json = pub._result_json(self)
        ttl = _ttl(self.result_ttl_s)
        f.settled.append(r.job_id)  # a first token after its result is none (and the job's entry is forgotten)
        if self.write_result:
            jh, out = keys.job_hash(r.job_id), keys.out_stream(r.job_id)
            job_hash.queue_final(f.pipe, jh, r.status, result_json, r.finished_at)
            f.pipe.xadd(out, end_fields(r.status.value, r))
            f.pipe.expire(jh, ttl)
            f.pipe.expire(out, ttl)
            queue_event(f.pipe, final_event_fields(r), pub.events_maxlen)
        if self.dead_letter is not None:
            job_id = None if r.job_id == UNKNOWN_JOB_ID else r.job_id
            pub.consumer.dead_letter(self.dead_letter, r.error or r.status.value, job_id, pipeline=f.pipe)
            queue_event(f.pipe, event_fields(EventType.DEAD_LETTERED, job_id or "", r.finished_at, lane=self.dead_letter.lane,
                                             error=r.error or r.status.value), pub.events_maxlen)
            f.acked.append((self.dead_letter.lane, self.dead_letter.entry_id))
        elif self.entry is not None:
            f.ack(self.entry[0], [self.entry[1]])
        if self.entry is not None:
            ctr = keys.done_counter(keys.split_lane_key(self.entry[0])[0], f.now_s)  # per lane, not per shard
            f.done[ctr] = f.done.get(ctr, 0) + 1


@dataclass(slots=True)
class Ack:
    lane: str
    entry_ids: list[str]

    def prepare(self, pub: Publisher) -> None:
        pass

    def write(self, pub: Publisher, f: _Flush) -> None:
        if self.entry_ids:
            f.ack(self.lane, self.entry_ids)


@dataclass(slots=True)
class HandBack:
    """Jobs that left this worker without a result (handed back at a stop or an engine failure, or a lease lost):
    forget what the publisher keeps for them (a first token still due, a TTL, a broken event), once the writes
    queued before this are in. Writes nothing to Redis."""

    job_ids: list[str]

    def prepare(self, pub: Publisher) -> None:
        pass

    def write(self, pub: Publisher, f: _Flush) -> None:
        # after this flush's deltas (a first token in it still gets its event); dropped once the flush lands
        f.settled.extend(self.job_ids)
        for job_id in self.job_ids:
            pub._out_ttl.pop(job_id, None)
            pub._broken.pop(job_id, None)


#: a write other than a token delta: each writes itself into a flush
Op = Start | Final | Ack | HandBack
#: what the loop hands ``Publisher.put`` (a None is skipped)
Item = Delta | Op | None


def acks(entries: list[tuple[str, str]]) -> list[Ack]:
    """One ``Ack`` per lane for (lane, entry_id) pairs."""
    by_lane: dict[str, list[str]] = {}
    for lane, eid in entries or []:
        by_lane.setdefault(lane, []).append(eid)
    return [Ack(lane, ids) for lane, ids in by_lane.items()]


@dataclass(slots=True)
class _Batch:
    deltas: list[Delta] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)


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
        self._items: list[Item] = []
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self._urgent = False
        self._thread = threading.Thread(target=self._run, name="pagestream-publisher", daemon=True)
        self.num_flushes = 0
        self.num_events = 0
        self.last_error: BaseException | None = None
        self._out_ttl: dict[str, int] = {}  # job_id -> TTL for its out stream, set with its first event
        # job_id -> (ttft counted from, worker, model) of a started job whose first_token event is still due
        self._first_token: dict[str, tuple[float, str, str | None]] = {}
        self._broken: dict[str, str] = {}  # job_id -> why its events cannot be written (its result fails)
        self._sharded = is_cluster(client)
        self.events_maxlen = events_maxlen()  # the firehose's bound (producer.protocol.events)

    def start(self) -> None:
        self._thread.start()

    def put(self, items: list[Item]) -> None:
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
        backoff = Backoff(base=0.05, cap=5.0)
        batch: list[Item] = []
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
                if not batch:
                    batch.extend(self._items)
                    self._items.clear()
                # else a batch whose transaction may have landed before the connection broke is
                # retried as it was, alone: the same events again, which subscribers drop whole by
                # their index. Merged with newer deltas, a replayed event would span tokens
                # already shown and repeat their text.
                self._urgent = False
                self._busy = True
            try:
                acked = self._write(batch)
                batch = []
                backoff.reset()
                last_flush = time.monotonic()
                self.num_flushes += 1
                if acked and self.on_acked:
                    self.on_acked(acked)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Keep the batch and retry it unchanged: a replayed event is dropped by subscribers by its index.
                self.last_error = exc
                delay = backoff.next()
                log.warning("publisher: redis unavailable (%s), retrying in %.2fs", exc, delay)
                time.sleep(delay)
            except Exception as exc:  # a bug must not cost the whole batch: write its items one by one
                self.last_error = exc
                log.exception("publisher: a batch of %d writes failed; writing them one at a time", len(batch))
                acked = self._write_each(batch)
                batch = []
                if acked and self.on_acked:
                    self.on_acked(acked)
            finally:
                with self._cond:
                    self._busy = bool(batch)
                    self._cond.notify_all()

    def _write(self, items: list[Item]) -> list[tuple[str, str]]:
        """One transaction for the batch; each item is serialized on its own first, so an item
        that cannot be written fails its own job (a failed result) and never the batch."""
        b = _coalesce(items)
        # Redis Cluster: one atomic script per slot, then the acks (worker.slot_batch says why)
        pipe = SlotBatch(self.redis) if self._sharded else self.redis.pipeline(transaction=True)
        now = time.time()
        f = _Flush(pipe, int(now))
        n_events = 0
        for op in b.ops:
            op.prepare(self)
        for d in b.deltas:
            if d.job_id in self._broken:
                continue
            try:
                fields = _encoded(token_event_fields(d.sample, d.index, d.token_ids, d.text, d.finish_reason, d.logprobs,
                                                         d.prompt_logprobs, d.prompt_tokens, d.prompt_token_ids))
            except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
                self._broken[d.job_id] = f"a token event could not be written: {exc}"
                log.error("job %s: %s", d.job_id, self._broken[d.job_id])
                continue
            out = keys.out_stream(d.job_id)
            pipe.xadd(out, fields)
            ttl = self._out_ttl.pop(d.job_id, None)
            if ttl is not None:  # a running job's stream expires too (its worker may die, unreclaimed)
                pipe.expire(out, ttl)
            n_events += 1
            if d.index == 0 and d.token_ids and d.job_id not in f.first_tokens:
                due = self._first_token.get(d.job_id)  # popped once the flush lands (a retried flush writes it again)
                if due is not None:
                    at = d.at if d.at is not None else now  # the step that made it (it is visible from this flush on)
                    f.first_tokens[d.job_id] = first_token_fields(d.job_id, at, due[0], due[1], due[2])
                    f.settled.append(d.job_id)
        # a job's first_token goes after its started event (Start.write queues it when both are in this flush)
        # and before its final one; the rest go before every op
        starting = {op.job_id for op in b.ops if isinstance(op, Start)}
        for job_id in [j for j in f.first_tokens if j not in starting]:
            queue_event(pipe, f.first_tokens.pop(job_id), self.events_maxlen)
        for op in b.ops:
            op.write(self, f)
        for lane, entry_ids in f.to_ack.items():
            self.consumer.ack(lane, entry_ids, pipeline=pipe)
        for ctr, n in f.done.items():
            pipe.incr(ctr, n)
            pipe.expire(ctr, 120)
        # A command Redis refuses (a key of the wrong type, NOGROUP after a flush) fails alone;
        # the rest of the transaction is applied, and its entries are settled either way.
        errors = [res for res in pipe.execute(raise_on_error=False) if isinstance(res, Exception)]
        for exc in errors:
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                raise exc
        if errors:
            log.warning("publisher: %d of the batch's writes were refused by Redis, first: %s", len(errors), errors[0])
        for job_id in f.settled:
            self._first_token.pop(job_id, None)
        self.num_events += n_events
        return f.acked

    def _write_each(self, items: list[Item]) -> list[tuple[str, str]]:
        """Last resort: only the item that breaks is lost; an entry it would have acked is acked alone."""
        acked: list[tuple[str, str]] = []
        for item in items:
            try:
                acked += self._write([item])
            except Exception:
                log.exception("publisher: dropping one write: %r", item)
                entry = getattr(item, "entry", None)
                if entry is not None:  # settle it: never a lease renewed forever for an entry nobody can finish
                    try:
                        self.consumer.ack(entry[0], [entry[1]])
                        acked.append(entry)
                    except redis.RedisError as exc:
                        log.warning("publisher: could not ack %s: %s", entry, exc)
        return acked

    def _result_json(self, op: Final) -> tuple[JobResult, str]:
        """The result to write; a job whose events or result cannot be written fails alone, saying why."""
        r = op.result
        self._out_ttl.pop(r.job_id, None)
        reason = self._broken.pop(r.job_id, None)
        if reason is None:
            try:
                text = r.model_dump_json()
                text.encode("utf-8")
                return r, text
            except (TypeError, ValueError) as exc:  # PydanticSerializationError is a ValueError
                reason = f"the result could not be written: {exc}"
                log.error("job %s: %s", r.job_id, reason)
        failed = JobResult(job_id=r.job_id, status=JobStatus.FAILED, error=safe_text(reason), worker=r.worker,
                           deliveries=r.deliveries, created_at=r.created_at, started_at=r.started_at)
        return failed, failed.model_dump_json()


def safe_text(s: str) -> str:
    """Text that can always be written as UTF-8 (lone surrogates become ``\\udxxx`` escapes)."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _encoded(fields: dict[str, str]) -> dict[str, bytes]:
    # what redis-py would do at execute time, done here so one bad value fails one item
    return {k: v.encode("utf-8") for k, v in fields.items()}


def _ttl(ttl_s: int) -> int:
    # a TTL Redis refuses (10**17 overflows its ms clock) would leave the key forever
    return max(1, min(int(ttl_s), MAX_KEY_TTL_S))


def _coalesce(items: list[Item]) -> _Batch:
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
                if cur.prompt_logprobs is None:
                    cur.prompt_logprobs = it.prompt_logprobs
                if cur.prompt_tokens is None:
                    cur.prompt_tokens, cur.prompt_token_ids = it.prompt_tokens, it.prompt_token_ids
                if it.logprobs is not None:  # cur's list is its own (copied below): extend in place
                    if cur.logprobs is None:
                        cur.logprobs = list(it.logprobs)
                    else:
                        cur.logprobs.extend(it.logprobs)
            else:
                cur = Delta(it.job_id, it.sample, it.index, list(it.token_ids), it.text, it.finish_reason,
                            None if it.logprobs is None else list(it.logprobs), it.prompt_logprobs, it.prompt_tokens,
                            it.prompt_token_ids, it.at)
                b.deltas.append(cur)
                open_delta[key] = cur
        else:
            b.ops.append(it)
    return b
