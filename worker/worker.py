"""The loop that joins the queue and the engine.

    pull (only what the engine can admit + prefetch) -> engine.add_request
    engine.step() -> deltas -> Publisher (a thread: coalesced, one transaction per flush)
    final result + status + XACK written together; bulk results to the bulk sink

Bulk jobs (``worker.bulk_jobs``): those of a bulk that is no longer live are
acked without running; while the bulk sink holds ``bulk_buffer_limit`` results
that are not durable yet, the loop pulls nothing new (it keeps stepping and
retrying flushes), so failing part writes cannot grow a worker without bound.

A control thread keeps leases alive, reads cancellations and trims lanes, so the
loop itself only talks to Redis when it pulls. ``run(burst=False, max_steps=None)``
is shaped like rq's ``Worker.work``: the first SIGTERM/SIGINT is a warm stop (no
more pulls, in-flight jobs drain up to ``drain_timeout_s``, the rest is released
for other workers), the second is cold.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from typing import Any

import redis

from pagestream.producer import keys
from pagestream.producer.schema import JobRequest, JobResult, JobStatus, SampleResult
from pagestream.worker.bulk_jobs import BulkJobs
from pagestream.worker.consumer import Consumer, Delivery
from pagestream.worker.control import ControlThread
from pagestream.worker.jobs import ActiveJob, InvalidJob, NoAckPipe, SampleOutput, load_history, parse_delivery, salvage
from pagestream.worker.metrics import WorkerMetrics
from pagestream.worker.publisher import Ack, Delta, Final, Publisher, Start, UNKNOWN_JOB_ID, safe_text
from pagestream.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        client: redis.Redis,
        engine: Any,
        settings: WorkerSettings,
        sink: Any = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.redis = client
        self.engine = engine
        self.settings = settings
        self.name = settings.consumer
        self.consumer = Consumer(client, settings)
        self.publisher = Publisher(client, self.consumer, settings.publish_interval_ms / 1000, on_acked=self._on_acked)
        self.bulk = BulkJobs(client, settings, sink)
        self._active: dict[str, ActiveJob] = {}  # job_id -> job in the engine
        self._buffer: deque[ActiveJob] = deque()  # pulled, validated, not yet in the engine
        self._held: set[tuple[str, str]] = set()  # (lane, entry_id) read and not yet acked, except bulk results in the sink
        self._lock = threading.Lock()  # guards _held, _cancel_requests, _lost
        self._cancel_requests: set[str] = set()
        self._lost: set[tuple[str, str]] = set()
        self._stop_requested = 0  # 1 warm, 2 cold
        self._stats_snapshot: dict[str, Any] = {}
        self._control_stop = threading.Event()
        self._control: threading.Thread | None = None
        self._next_reclaim = 0.0
        self._next_snapshot = 0.0
        self._tokens_seen = 0
        self.metrics = metrics or WorkerMetrics()
        self._pull_paused_until = 0.0
        self._pull_backoff = 0.1
        self.num_steps = 0
        self.num_completed = 0
        self.queue_time_s = 0.0  # loop time spent outside engine.step (what the queue costs)
        self.engine_time_s = 0.0

    # -- public -----------------------------------------------------------------------------

    @property
    def admission_limit(self) -> int:
        return self.settings.max_num_seqs

    def request_stop(self, cold: bool = False) -> None:
        self._stop_requested = 2 if cold else max(self._stop_requested, 1)

    def run(self, burst: bool = False, max_steps: int | None = None) -> int:
        """Work until stopped (or, with ``burst``, until the queue is empty and nothing runs).

        Returns the number of engine steps taken. ``max_steps`` stops after that many
        steps without draining (a test hook: in-flight jobs stay in the engine).
        """
        self._install_signals()
        first_run = self._control is None
        self._start_threads()
        steps_at_start = self.num_steps
        backoff = 0.1
        paused = False
        try:
            if first_run:
                self._recover()
            while True:
                if self._stop_requested:
                    break
                if max_steps is not None and self.num_steps - steps_at_start >= max_steps:
                    paused = True  # a test hook: in-flight jobs stay; call run() again or close()
                    return self.num_steps - steps_at_start
                try:
                    did_work = self._iteration(block=not burst)
                    backoff = 0.1
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    log.warning("redis unavailable (%s); retrying in %.1fs", exc, backoff)
                    self._sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
                    continue
                except Exception:
                    # Not a job's fault (jobs fail through results): hand in-flight work back
                    # so it is redelivered (and dead-lettered after max_deliveries), keep serving.
                    log.exception("worker iteration failed; releasing %d in-flight jobs", len(self._active))
                    self._abort_all_and_release()
                    self._sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
                    continue
                if not did_work and not self._busy():
                    if self.publisher.pending():
                        # acks in flight still count against the PEL bound: let them land first
                        self.publisher.flush(timeout=1.0)
                        continue
                    if burst:
                        break
                    if self._capacity() <= 0:
                        self._sleep(0.01)
            self._drain()
        finally:
            if not paused:
                self._teardown()
            self._restore_signals()
        return self.num_steps - steps_at_start

    def close(self) -> None:
        """Release everything (for callers that used ``run(max_steps=...)``)."""
        if not self._control_stop.is_set():
            self._teardown()

    # -- one iteration ----------------------------------------------------------------------

    def _iteration(self, block: bool) -> bool:
        t0 = time.perf_counter()
        self._handle_control_events()
        pulled = 0
        if time.monotonic() >= self._pull_paused_until:
            try:
                self._poll_sink()
                pulled = self._pull(block=block and not self._busy())
                self._pull_backoff = 0.1
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if not self._busy():
                    raise  # nothing to step: the run loop backs off
                # Keep stepping the jobs we have (the publisher thread retries their writes);
                # try pulling again after a backoff.
                log.warning("redis unavailable while pulling (%s); stepping on, next pull in %.1fs", exc, self._pull_backoff)
                self._pull_paused_until = time.monotonic() + self._pull_backoff
                self._pull_backoff = min(self._pull_backoff * 2, 10.0)
        self._admit()
        did_step = False
        if self.engine.has_unfinished_requests():
            t1 = time.perf_counter()
            outputs = self.engine.step()
            t2 = time.perf_counter()
            self.engine_time_s += t2 - t1
            self.num_steps += 1
            self.metrics.steps.inc()
            self.metrics.step_seconds.observe(t2 - t1)
            self._publish(outputs)
            did_step = True
            dq = (t1 - t0) + (time.perf_counter() - t2)
        else:
            dq = time.perf_counter() - t0
        self.queue_time_s += dq
        self.metrics.queue_seconds.inc(dq)
        if time.monotonic() >= self._next_snapshot:
            self._next_snapshot = time.monotonic() + 0.5
            self._snapshot_stats()
        return did_step or pulled > 0

    def _busy(self) -> bool:
        return bool(self._active or self._buffer or self.engine.has_unfinished_requests())

    def _capacity(self) -> int:
        """How many more entries to read now: never more than admission limit + prefetch held,
        and none while the bulk sink holds ``bulk_buffer_limit`` results that are not durable yet."""
        if self.bulk.full():
            return 0
        with self._lock:
            held = len(self._held)
        by_pel = self.admission_limit + self.settings.prefetch - held
        by_engine = self.engine.num_admittable() + self.settings.prefetch - len(self._buffer)
        return max(0, min(by_pel, by_engine))

    def _pull(self, block: bool) -> int:
        want = self._capacity()
        if want <= 0:
            return 0
        deliveries: list[Delivery] = []
        now = time.monotonic()
        if now >= self._next_reclaim:
            self._next_reclaim = now + self.settings.reclaim_every_s
            deliveries = self.consumer.reclaim(want)
        if len(deliveries) < want:
            deliveries += self.consumer.read(want - len(deliveries), block_ms=self.settings.block_ms if block and not deliveries else None)
        if deliveries:
            self._accept(deliveries)
        return len(deliveries)

    # -- taking deliveries in -----------------------------------------------------------------

    def _accept(self, deliveries: list[Delivery]) -> None:
        """Validate pulled entries; queue runnable ones in the buffer, finish the rest at once."""
        ops: list[object] = []
        ready: list[ActiveJob] = []
        for d in deliveries:
            with self._lock:
                self._held.add((d.lane, d.entry_id))
            try:
                a = self._check_entry(d, ops)
            except Exception as exc:  # whatever one entry does, it fails alone: the batch and the loop go on
                log.exception("entry %s/%s could not be processed", d.lane, d.entry_id)
                ops.extend(self._reject(d, f"entry could not be processed: {type(exc).__name__}: {exc}"))
                continue
            if a is not None:
                ready.append(a)
        if ready:
            try:
                ops.extend(self._check_state(ready))
            except redis.RedisError:
                # Not started: stop holding them, so their leases lapse and they are reclaimed.
                with self._lock:
                    self._held.difference_update((a.delivery.lane, a.delivery.entry_id) for a in ready)
                ids = {id(a) for a in ready}
                self._buffer = deque(a for a in self._buffer if id(a) not in ids)
                self.publisher.put(ops)
                raise
        self.publisher.put(ops)

    def _check_entry(self, d: Delivery, ops: list[object]) -> ActiveJob | None:
        if d.fields is None:  # deleted from the stream while pending
            ops.append(Ack(d.lane, [d.entry_id]))
            return None
        try:
            job = parse_delivery(d, self.settings.max_entry_bytes)
        except InvalidJob as exc:
            ops.extend(self._reject(d, str(exc)))
            return None
        if d.deliveries > self.settings.max_deliveries:
            ops.extend(self._reject(d, f"failed {d.deliveries - 1} deliveries (max_deliveries={self.settings.max_deliveries})", job))
            return None
        mine = self._active.get(job.job_id) or next((a for a in self._buffer if a.job_id == job.job_id), None)
        if mine is not None:
            if (mine.delivery.lane, mine.delivery.entry_id) != (d.lane, d.entry_id):
                ops.append(Ack(d.lane, [d.entry_id]))  # a second entry for a job this worker already runs
            return None
        return ActiveJob(d, job)

    def _reject(self, d: Delivery, reason: str, job: JobRequest | None = None) -> list[object]:
        """An invalid or poison entry: failed result (if it names a job), copy to the DLQ, ack."""
        reason = safe_text(reason)
        log.info("dead-lettering %s/%s: %s", d.lane, d.entry_id, reason[:500])
        self.metrics.dead_letters.inc()
        self.metrics.jobs.labels(JobStatus.FAILED.value).inc()
        job_id, output, ttl, meta = salvage(d, job, self.settings.max_entry_bytes)
        result = JobResult(job_id=job_id or UNKNOWN_JOB_ID, status=JobStatus.FAILED, error=reason, worker=self.name, deliveries=d.deliveries, metadata=meta)
        if output is not None and output.kind == "bulk":
            stub = job or JobRequest.model_construct(job_id=job_id or f"entry-{d.entry_id}", output=output, metadata=meta)
            if self._to_sink(d, stub, result):
                # the sink acks it once durable; the DLQ still gets a copy
                self.consumer.dead_letter(d, reason, job_id, pipeline=NoAckPipe(self.redis))
                return []
        return [Final(result, ttl, (d.lane, d.entry_id), dead_letter=d, write_result=job_id is not None)]

    def _check_state(self, jobs: list[ActiveJob]) -> list[object]:
        """One round trip for the job hashes: skip finished/cancelled jobs, expire late ones, find resumes."""
        ops: list[object] = []
        pipe = self.redis.pipeline(transaction=False)
        for a in jobs:
            pipe.hmget(keys.job_hash(a.job_id), ["status", "cancel_requested"])
        states = pipe.execute()
        resume_from: list[ActiveJob] = []
        now = time.time()
        for a, (status, cancel_requested) in zip(jobs, states):
            st = status.decode() if status else None
            a.has_job_hash = st is not None
            if a.is_bulk:
                pass
            elif st in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED):
                ops.append(Ack(a.delivery.lane, [a.delivery.entry_id]))
                continue
            elif cancel_requested:
                ops.append(self._final(a, JobStatus.CANCELLED, error="cancelled"))
                continue
            if a.job.is_expired(now):
                ops.append(self._final(a, JobStatus.EXPIRED, error=f"deadline passed {now - a.job.deadline:.3f}s before it started"))
                continue
            try:
                a.params = self._sampling_params(a.job)
            except (ValueError, TypeError) as exc:
                ops.extend(self._reject(a.delivery, f"invalid sampling parameters: {exc}", a.job))
                continue
            if st == JobStatus.RUNNING and not a.is_bulk:
                resume_from.append(a)
            self._buffer.append(a)
        if resume_from:
            load_history(self.redis, resume_from)
        return ops

    def _sampling_params(self, job: JobRequest) -> Any:
        from pagestream.engine.sampling_params import SamplingParams

        return SamplingParams(**job.sampling.engine_kwargs())

    def _admit(self) -> None:
        """Move buffered jobs into the engine as far as it can admit them now."""
        if not self._buffer:
            return
        n = self.engine.num_admittable()
        ops: list[object] = []
        skipped: list[ActiveJob] = []
        now = time.time()
        while self._buffer:
            a = self._buffer[0]
            if a.is_bulk and not self.bulk.is_live(a.job):
                self._buffer.popleft()
                self.metrics.jobs.labels(JobStatus.CANCELLED.value).inc()
                ops.append(self.bulk.skip(a, self.name))
                skipped.append(a)
                continue
            if n <= 0:
                break
            a = self._buffer.popleft()
            if a.job.is_expired(now):
                ops.append(self._final(a, JobStatus.EXPIRED, error="deadline passed before it started"))
                continue
            j = a.job
            kw = dict(params=a.params, resume_token_ids=a.resume, priority=j.priority)
            try:
                if j.messages is not None:
                    self.engine.add_chat_request(j.job_id, [m.model_dump() for m in j.messages], **kw)
                elif j.prompt_token_ids is not None:
                    self.engine.add_request(j.job_id, prompt_token_ids=j.prompt_token_ids, **kw)
                else:
                    self.engine.add_request(j.job_id, prompt=j.prompt, **kw)
            except ValueError as exc:
                ops.extend(self._reject(a.delivery, f"rejected by the engine: {exc}", j))
                continue
            except Exception as exc:  # an engine bug on this input: the job fails, the worker goes on
                log.exception("add_request(%s) failed", j.job_id)
                ops.extend(self._reject(a.delivery, f"the engine could not take this job: {type(exc).__name__}: {exc}", j))
                continue
            a.started_at = time.time()
            self._active[j.job_id] = a
            n -= 1
            if not a.is_bulk:
                ops.append(Start(j.job_id, self.name, a.started_at, a.delivery.deliveries, j.result_ttl_s))
        self.publisher.put(ops)
        if skipped:
            self.bulk.record_skipped(skipped)

    # -- results --------------------------------------------------------------------------------

    def _publish(self, outputs: list) -> None:
        # Hot path (every step, every running job): plain attribute reads only.
        ops: list[object] = []
        append = ops.append
        active = self._active
        for out in outputs:
            a = active.get(out.request_id)
            if a is None:
                continue
            if not a.prompt_tokens and out.prompt_token_ids:
                a.prompt_tokens = len(out.prompt_token_ids)
            samples = a.samples
            for c in out.outputs:
                s = samples.get(c.index)
                if s is None:
                    s = samples[c.index] = SampleOutput()
                ids, text, fin = c.token_ids, c.text, c.finish_reason
                if not ids and not text and (fin is None or s.finish_reason is not None):
                    continue  # nothing new (or a sample that finished earlier, reported again)
                s.token_ids.extend(ids)
                if text:
                    s.text.append(text)
                if fin is not None:
                    s.finish_reason = fin
                if not a.is_bulk:
                    append(Delta(a.job_id, c.index, c.first_token_index, ids, text, fin))
            if out.finished:
                del self._active[a.job_id]
                if out.error:
                    ops.extend(self._reject(a.delivery, f"engine error: {out.error}", a.job))
                else:
                    ops.append(self._final(a, JobStatus.COMPLETED))
                    self.num_completed += 1
        self.publisher.put(ops)

    def _final(self, a: ActiveJob, status: JobStatus, error: str | None = None) -> object | None:
        self.metrics.jobs.labels(status.value).inc()
        samples = [
            SampleResult(index=i, text="".join(s.text), token_ids=s.token_ids, finish_reason=s.finish_reason)
            for i, s in sorted(a.samples.items())
        ]
        first = samples[0] if samples else None
        result = JobResult(
            job_id=a.job_id,
            status=status,
            text=first.text if first else "",
            token_ids=first.token_ids if first else [],
            finish_reason=first.finish_reason if first else None,
            error=error,
            outputs=samples,
            prompt_tokens=a.prompt_tokens,
            completion_tokens=sum(len(s.token_ids) for s in samples),
            worker=self.name,
            deliveries=a.delivery.deliveries,
            resumed_from=len(a.resume or []),
            created_at=a.job.created_at,
            started_at=a.started_at or None,
            metadata=a.job.metadata,
        )
        if a.is_bulk:
            if self._to_sink(a.delivery, a.job, result):
                return None  # acked later by the sink, once its part is durable
            result = result.model_copy(update={"status": JobStatus.FAILED, "error": self.bulk.error})
            return Final(result, a.job.result_ttl_s, (a.delivery.lane, a.delivery.entry_id), dead_letter=a.delivery, write_result=False)
        return Final(result, a.job.result_ttl_s, (a.delivery.lane, a.delivery.entry_id))

    # -- bulk sink --------------------------------------------------------------------------------

    def _to_sink(self, d: Delivery, job: JobRequest, result: JobResult) -> bool:
        if not self.bulk.to_sink(d, job, result):
            return False
        with self._lock:
            self._held.discard((d.lane, d.entry_id))  # the sink's entries are bounded by bulk_buffer_limit instead
        return True

    def _poll_sink(self) -> None:
        self._ack_pairs(self.bulk.poll())

    def _ack_pairs(self, pairs: list[tuple[str, str]]) -> None:
        by_lane: dict[str, list[str]] = {}
        for lane, eid in pairs or []:
            by_lane.setdefault(lane, []).append(eid)
        self.publisher.put([Ack(lane, ids) for lane, ids in by_lane.items()])

    def _on_acked(self, pairs: list[tuple[str, str]]) -> None:
        with self._lock:
            self._held.difference_update(pairs)
        self.bulk.on_acked(pairs)

    # -- cancellation, deadlines, lost leases -------------------------------------------------------

    def _handle_control_events(self) -> None:
        with self._lock:
            cancels, self._cancel_requests = self._cancel_requests, set()
            lost, self._lost = self._lost, set()
        ops: list[object] = []
        for lane, eid in lost:
            for a in list(self._active.values()):
                if (a.delivery.lane, a.delivery.entry_id) == (lane, eid):
                    log.warning("lost the lease of %s (job %s) to another worker; dropping it", eid, a.job_id)
                    self.engine.abort_request(a.job_id)
                    del self._active[a.job_id]
            self._buffer = deque(a for a in self._buffer if (a.delivery.lane, a.delivery.entry_id) != (lane, eid))
            with self._lock:
                self._held.discard((lane, eid))
        now = time.time()
        for a in list(self._active.values()):
            if a.job_id in cancels:
                self.engine.abort_request(a.job_id)
                del self._active[a.job_id]
                ops.append(self._final(a, JobStatus.CANCELLED, error="cancelled"))
            elif a.job.deadline is not None and now > a.job.deadline:
                self.engine.abort_request(a.job_id)
                del self._active[a.job_id]
                ops.append(self._final(a, JobStatus.EXPIRED, error="deadline passed while running"))
        if cancels and self._buffer:
            keep = deque()
            for a in self._buffer:
                if a.job_id in cancels:
                    ops.append(self._final(a, JobStatus.CANCELLED, error="cancelled"))
                else:
                    keep.append(a)
            self._buffer = keep
        self.publisher.put([op for op in ops if op is not None])

    # -- threads ----------------------------------------------------------------------------------

    def _start_threads(self) -> None:
        if self._control is not None:
            return
        self.consumer.ensure_groups()
        self.publisher.start()
        self._control = ControlThread(self)
        self._control.start()

    def _snapshot_stats(self) -> None:
        st = self.engine.stats()
        m = self.metrics
        m.tokens.inc(max(0, st.num_generated_tokens - self._tokens_seen))
        self._tokens_seen = st.num_generated_tokens
        m.running.set(st.num_running + st.num_waiting)
        m.held.set(len(self._held))
        m.kv_usage.set(st.kv_usage)
        self._stats_snapshot = {
            "num_running": st.num_running,
            "num_waiting": st.num_waiting,
            "num_free_blocks": st.num_free_blocks,
            "num_total_blocks": st.num_total_blocks,
            "kv_usage": round(st.kv_usage, 4),
            "num_steps": self.num_steps,
            "num_completed": self.num_completed,
            "held": len(self._held),
            "updated_at": round(time.time(), 3),
        }

    # -- start, stop ------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Entries left in this consumer's PEL by an earlier process with the same name."""
        want = self._capacity()
        if want > 0:
            ds = self.consumer.recover_own(want)
            if ds:
                log.info("recovered %d entries from our own PEL", len(ds))
                self._accept(ds)

    def _drain(self) -> None:
        """Warm stop: no more pulls; finish in-flight jobs up to the drain timeout."""
        if self._stop_requested != 1:
            return
        end = time.monotonic() + self.settings.drain_timeout_s
        log.info("warm stop: draining %d running jobs (up to %.1fs)", len(self._active), self.settings.drain_timeout_s)
        self._release_buffer()
        while self._stop_requested == 1 and self.engine.has_unfinished_requests() and time.monotonic() < end:
            try:
                self._handle_control_events()
                self._poll_sink()
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            t1 = time.perf_counter()
            outputs = self.engine.step()
            self.engine_time_s += time.perf_counter() - t1
            self.num_steps += 1
            self._publish(outputs)

    def _abort_all_and_release(self) -> None:
        unfinished = list(self._active.values())
        for a in unfinished:
            try:
                self.engine.abort_request(a.job_id)
            except Exception:
                log.exception("abort_request(%s) failed", a.job_id)
        self._active.clear()
        self.publisher.flush(timeout=5.0)
        # these deliveries count: a job that keeps breaking the step ends in the DLQ
        self._release([a.delivery for a in unfinished if not a.is_bulk], count_delivery=True)
        self._release_buffer()
        # Whatever is still held now is in no job list (the failure hit between read and
        # buffer): let it go too rather than keep its lease alive forever.
        with self._lock:
            leftover = list(self._held)
        if leftover:
            self._release([Delivery(lane, eid, None, 0) for lane, eid in leftover])  # 0: count unknown, left as is

    def _release_buffer(self) -> None:
        released = [a.delivery for a in self._buffer]
        self._buffer.clear()
        self._release(released)

    def _release(self, deliveries: list[Delivery], count_delivery: bool = False) -> None:
        """Hand entries back: mark them idle past the lease so any worker reclaims them at once.

        A stop is not the job's fault, so by default the delivery is not counted toward
        ``max_deliveries`` (the reclaim will count the next one).
        """
        for d in deliveries:
            try:
                self.redis.xclaim(
                    keys.jobs_stream(d.lane), self.settings.group, self.name, 0, [d.entry_id],
                    idle=self.settings.lease_ms + 1,
                    retrycount=None if d.deliveries <= 0 else d.deliveries if count_delivery else d.deliveries - 1,
                    justid=True,
                )
            except redis.RedisError as exc:
                log.warning("could not release %s: %s", d.entry_id, exc)
            with self._lock:
                self._held.discard((d.lane, d.entry_id))

    def _teardown(self) -> None:
        # Jobs still in the engine (drain timed out, cold stop, max_steps): abort them and
        # release their entries; whoever reclaims them resumes from the published tokens.
        unfinished = list(self._active.values())
        for a in unfinished:
            self.engine.abort_request(a.job_id)
        self._active.clear()
        self.publisher.flush(timeout=5.0 if self._stop_requested != 2 else 1.0)
        try:
            self._ack_pairs(self.bulk.close())
        except Exception:
            log.exception("bulk sink close failed")
        self._release([a.delivery for a in unfinished if not a.is_bulk])
        self._release_buffer()
        self.publisher.stop(timeout=5.0)
        self._control_stop.set()
        if self._control is not None:
            self._control.join(timeout=5)

    def _sleep(self, s: float) -> None:
        end = time.monotonic() + s
        while not self._stop_requested and time.monotonic() < end:
            time.sleep(min(0.05, end - time.monotonic()))

    def _install_signals(self) -> None:
        self._old_handlers = {}
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):  # noqa: ARG001
            self.request_stop(cold=self._stop_requested >= 1)
            log.warning("%s: %s stop", signal.Signals(signum).name, "cold" if self._stop_requested == 2 else "warm")

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signals(self) -> None:
        for sig, h in getattr(self, "_old_handlers", {}).items():
            signal.signal(sig, h)
