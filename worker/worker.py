"""The loop that joins the queue and the engine: run, iteration, drain, teardown.

    Intake.pull (only what the engine can admit + prefetch) -> accept -> admit -> engine
    engine.step() -> Results.publish -> Publisher (a thread: one transaction per flush)

Bulk results go to the bulk sink (``worker.bulk_jobs``); while it holds too many that
are not durable yet, nothing new is pulled. A control thread keeps leases alive, reads
cancels and trims lanes; the threads share ``LoopState``. ``run(burst=False,
max_steps=None)`` is shaped like rq's ``Worker.work``: the first SIGTERM/SIGINT is a
warm stop (no more pulls, in-flight jobs drain up to ``drain_timeout_s``, the rest is
released for other workers), the second is cold.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import redis

from pagestream.engine.errors import EngineDeadError
from pagestream.producer.protocol.redis_conn import Backoff
from pagestream.producer.protocol.schema import JobStatus
from pagestream.worker.bulk_jobs import BulkJobs
from pagestream.worker.consumer import Consumer, Delivery
from pagestream.worker.control import ControlThread
from pagestream.worker.engine_api import Engine
from pagestream.worker.intake import Intake
from pagestream.worker.job_table import JobTable
from pagestream.worker.jobs import ActiveJob
from pagestream.worker.loop_state import LoopState
from pagestream.worker.metrics import WorkerMetrics
from pagestream.worker.publisher import HandBack, Publisher, acks
from pagestream.worker.results import Results
from pagestream.worker.settings import WorkerSettings
from pagestream.worker.signals import stop_signals

log = logging.getLogger(__name__)

#: how often the loop looks for running jobs past their deadline (a scan of every running job)
DEADLINE_SCAN_S = 0.05


class Worker:
    def __init__(self, client: redis.Redis, engine: Engine, settings: WorkerSettings, sink: Any = None,
                 metrics: WorkerMetrics | None = None) -> None:
        self.redis, self.engine, self.settings, self.name = client, engine, settings, settings.consumer
        if settings.max_num_seqs is None:  # read as many jobs as the engine runs at once
            settings.max_num_seqs = engine.config.max_num_seqs
        self.metrics = metrics or WorkerMetrics(model_name=settings.served_model_name or settings.model or "")
        self.state = LoopState()
        self.consumer = Consumer(client, settings)
        self.publisher = Publisher(client, self.consumer, settings.publish_interval_ms / 1000, on_acked=self._on_acked)
        self.bulk = BulkJobs(client, settings, sink)
        self.jobs = JobTable()  # buffered and running jobs, shared with intake and results
        self.results = Results(client, settings, self.consumer, self.bulk, self.state, self.metrics)
        self.results.token_texts.tokenizer = engine.tokenizer  # logprobs name their tokens
        self.intake = Intake(client, engine, settings, self.consumer, self.state, self.results, self.bulk, self.metrics, self.jobs, self.publisher.put)
        self._stop_requested = 0  # 1 warm, 2 cold
        self._control: ControlThread | None = None
        self._next_snapshot = 0.0
        self._next_deadline_scan = 0.0
        self.num_steps = 0
        self.queue_time_s = 0.0  # loop time spent outside engine.step (what the queue costs)
        self.engine_time_s = 0.0

    num_completed = property(lambda self: self.results.num_completed)
    # cancels and lost leases the loop has not acted on yet (tests wait on them)
    _cancel_requests = property(lambda self: self.state.pending_events()[0])
    _lost = property(lambda self: self.state.pending_events()[1])

    def request_stop(self, cold: bool = False) -> None:
        self._stop_requested = 2 if cold else max(self._stop_requested, 1)

    def _signalled(self) -> bool:
        self.request_stop(cold=self._stop_requested >= 1)
        return self._stop_requested == 2

    def run(self, burst: bool = False, max_steps: int | None = None) -> int:
        """Work until stopped (or, with ``burst``, until the queue is empty and nothing runs).

        Returns the number of engine steps taken. ``max_steps`` stops after that many
        steps without draining (a test hook: in-flight jobs stay in the engine).
        """
        with stop_signals(self._signalled):
            return self._run(burst, max_steps)

    def _run(self, burst: bool, max_steps: int | None) -> int:
        first_run = self._control is None
        self._start_threads()
        steps_at_start = self.num_steps
        backoff = Backoff(base=0.1, cap=10.0)
        paused = False
        try:
            if first_run:
                self.intake.recover()
            while not self._stop_requested:
                if max_steps is not None and self.num_steps - steps_at_start >= max_steps:
                    paused = True  # a test hook: in-flight jobs stay; call run() again or close()
                    return self.num_steps - steps_at_start
                try:
                    did_work = self._iteration(block=not burst)
                    backoff.reset()
                except EngineDeadError as exc:
                    # No later step can succeed (a tensor-parallel rank died): exit, and let the teardown
                    # hand every job back for other workers to reclaim, rather than fail every job through
                    # max_deliveries here.
                    log.critical("the engine died (%s); stopping this worker so its jobs go to others", exc)
                    raise
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    delay = backoff.next()
                    log.warning("redis unavailable (%s); retrying in %.1fs", exc, delay)
                    self._sleep(delay)
                    continue
                except Exception:
                    # Not a job's fault (jobs fail through results): hand in-flight work back
                    # so it is redelivered (and dead-lettered after max_deliveries), keep serving.
                    log.exception("worker iteration failed; releasing %d in-flight jobs", self.jobs.num_in_flight())
                    self._abort_and_release(count_delivery=True)
                    self._sleep(backoff.next())
                    continue
                if not did_work and not self._busy():
                    if self.publisher.pending():
                        # acks in flight still count against the PEL bound: let them land first
                        self.publisher.flush(timeout=1.0)
                        continue
                    if burst:
                        break
                    if self.intake.capacity() <= 0:
                        self._sleep(0.01)
            self._drain()
        finally:
            if not paused:
                self._teardown()
        return self.num_steps - steps_at_start

    def close(self) -> None:
        """Release everything (for callers that used ``run(max_steps=...)``)."""
        if not self.state.stopping.is_set():
            self._teardown()


    def _iteration(self, block: bool) -> bool:
        t0 = time.perf_counter()
        self._handle_control_events()
        busy = self._busy()
        pulled = self.intake.pull(block=block and not busy, busy=busy, before=self._poll_sink)
        self.intake.admit()
        dq = time.perf_counter() - t0
        did_step = self.engine.has_unfinished_requests()
        if did_step:
            dq += self._step()
        self.queue_time_s += dq
        self.metrics.queue_seconds.inc(dq)
        if time.monotonic() >= self._next_snapshot:
            self._next_snapshot = time.monotonic() + 0.5
            self.state.stats_snapshot = self.metrics.observe(self.engine.stats(), self.state.num_held(), self.num_steps, self.num_completed)
        return did_step or pulled > 0

    def _step(self) -> float:
        """One engine step, its outputs to the publisher; returns the time spent outside the step."""
        t1 = time.perf_counter()
        outputs = self.engine.step()
        t2 = time.perf_counter()
        self.engine_time_s += t2 - t1
        self.num_steps += 1
        self.metrics.observe_step(t2 - t1, self.engine.take_iteration_tokens())
        self.publisher.put(self.results.publish(outputs, self.jobs))
        return time.perf_counter() - t2

    def _busy(self) -> bool:
        return bool(self.jobs or self.engine.has_unfinished_requests())

    def _poll_sink(self) -> None:
        self.publisher.put(acks(self.bulk.poll()))

    def _on_acked(self, pairs: list[tuple[str, str]]) -> None:  # the publisher thread, after each flush
        self.state.unhold(pairs)
        self.bulk.on_acked(pairs)

    def _handle_control_events(self) -> None:
        """Cancels, lost leases and deadlines, before the next step."""
        cancels, lost = self.state.take_events()
        mono = time.monotonic()
        if not (cancels or lost) and mono < self._next_deadline_scan:
            return  # nothing happened, and running jobs' deadlines are looked at every DEADLINE_SCAN_S
        self._next_deadline_scan = mono + DEADLINE_SCAN_S
        ops: list[object] = []
        now = time.time()
        for a in self.jobs.running():
            if (a.delivery.lane, a.delivery.entry_id) in lost:
                log.warning("lost the lease of %s (job %s) to another worker; dropping it", a.delivery.entry_id, a.job_id)
                self._abort(a)
                ops.append(HandBack([a.job_id]))  # no result from here: the publisher forgets the job
            elif a.job_id in cancels:
                self._abort(a)
                ops.append(self.results.finish(a, JobStatus.CANCELLED, error="cancelled"))
            elif a.job.deadline is not None and now > a.job.deadline:
                self._abort(a)
                ops.append(self.results.finish(a, JobStatus.EXPIRED, error="deadline passed while running"))
        if (lost or cancels) and self.jobs.num_buffered():
            ops.extend(self.intake.drop(lost, cancels))
        self.state.unhold(lost)
        self.publisher.put([op for op in ops if op is not None])


    def _start_threads(self) -> None:
        if self._control is not None:
            return
        self.consumer.ensure_groups()
        self.publisher.start()
        self._control = ControlThread(self.redis, self.settings, self.consumer, self.state, self.bulk)
        self._control.start()

    def _drain(self) -> None:
        """Warm stop: no more pulls; finish in-flight jobs up to the drain timeout."""
        if self._stop_requested != 1:
            return
        end = time.monotonic() + self.settings.drain_timeout_s
        log.info("warm stop: draining %d running jobs (up to %.1fs)", self.jobs.num_running(), self.settings.drain_timeout_s)
        self._release(self.intake.take_buffer())
        while self._stop_requested == 1 and self.engine.has_unfinished_requests() and time.monotonic() < end:
            try:
                self._handle_control_events()
                self._poll_sink()
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            self._step()

    def _abort(self, a: ActiveJob) -> None:
        try:
            self.engine.abort_request(a.job_id)
        except Exception:
            log.exception("abort_request(%s) failed", a.job_id)
        self.jobs.finish(a.job_id)

    def _abort_and_release(self, count_delivery: bool = False, flush_s: float = 5.0) -> None:
        """Abort every job in the engine and hand every entry back for a re-run.

        ``count_delivery``: the loop broke (not a stop), so the delivery counts toward
        ``max_deliveries``, and entries held in no job list are let go too.
        """
        unfinished = self.jobs.running()
        for a in unfinished:
            self._abort(a)
        # handed back without a result: the publisher forgets them once the writes queued before are in
        self.publisher.put([HandBack([a.job_id for a in unfinished if not a.is_bulk])] if unfinished else [])
        self.publisher.flush(timeout=flush_s)
        # whoever reclaims them resumes from the published tokens
        self._release([a.delivery for a in unfinished if not a.is_bulk], count_delivery=count_delivery)
        self._release(self.intake.take_buffer())
        if count_delivery:  # held between read and buffer when the failure hit: never leased forever
            self._release([Delivery(lane, eid, None, 0) for lane, eid in self.state.held()])  # 0: count left as is

    def _release(self, deliveries: list[Delivery], count_delivery: bool = False) -> None:
        with self.state.leases:  # no lease refresh between the two (LoopState.leases)
            self.consumer.release(deliveries, count_delivery=count_delivery)
            self.state.unhold((d.lane, d.entry_id) for d in deliveries)

    def _teardown(self) -> None:
        # Jobs still in the engine (drain timed out, cold stop, max_steps) are aborted and released.
        self._abort_and_release(flush_s=5.0 if self._stop_requested != 2 else 1.0)
        try:
            self.publisher.put(acks(self.bulk.close()))
        except Exception:
            log.exception("bulk sink close failed")
        self.publisher.stop(timeout=5.0)
        self.state.stopping.set()
        if self._control is not None:
            self._control.join(timeout=5)
        try:  # a clean stop leaves no consumer behind in `pagestream stats`; one still holding entries stays
            self.consumer.leave()
        except redis.RedisError as exc:
            log.warning("could not remove consumer %s from the group: %s", self.consumer.name, exc)

    def _sleep(self, s: float) -> None:
        end = time.monotonic() + s
        while not self._stop_requested and time.monotonic() < end:
            time.sleep(min(0.05, end - time.monotonic()))
