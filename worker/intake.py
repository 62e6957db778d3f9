"""Taking lane entries in: pull, accept (parse, check), reject, check the job hashes, admit into the engine.

``pull`` reads only what the engine can admit plus ``prefetch`` (the PEL this worker
holds stays bounded) and none while the bulk sink is full.

Whatever one entry holds, it fails alone: a failed result when it names a job, a copy
in the DLQ, an ack. Runnable jobs wait in ``buffer`` (pulled, validated, not yet in the
engine) until the engine can take them; ``admit`` moves them into the engine and into
running in the ``JobTable`` the loop and results share.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from pagestream.engine.errors import EngineDeadError
from pagestream.producer.protocol import job as job_hash
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.redis_conn import Backoff
from pagestream.producer.protocol.schema import ErrorCode, JobRequest, JobStatus
from pagestream.worker.bulk_jobs import BulkJobs
from pagestream.worker.consumer import Consumer, Delivery
from pagestream.worker.engine_api import Engine
from pagestream.worker.job_table import JobTable
from pagestream.worker.jobs import ActiveJob, InvalidJob, claim_entries, load_history, parse_delivery
from pagestream.worker.loop_state import Entry, LoopState
from pagestream.worker.metrics import WorkerMetrics
from pagestream.worker.publisher import Ack, Start
from pagestream.worker.results import Results
from pagestream.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

#: how often a stepping engine with no room for another job reads the lanes (for its prefetch)
FULL_PULL_INTERVAL_S = 0.1
#: entries checked and admitted together when a read returns a burst
ACCEPT_CHUNK = 32

class Intake:
    def __init__(
        self,
        client: redis.Redis,
        engine: Engine,
        settings: WorkerSettings,
        consumer: Consumer,
        state: LoopState,
        results: Results,
        bulk: BulkJobs,
        metrics: WorkerMetrics,
        jobs: JobTable,
        put: Callable[[list[object]], None],
    ) -> None:
        self.redis = client
        self.engine = engine
        self.settings = settings
        self.consumer = consumer
        self.state = state
        self.results = results
        self.bulk = bulk
        self.metrics = metrics
        self.jobs = jobs
        self.put = put  # the publisher's queue
        self._next_reclaim = 0.0
        self._pull_paused_until = 0.0
        self._last_busy_pull = 0.0
        self._pull_backoff = Backoff(base=0.1, cap=10.0)

    def capacity(self) -> int:
        """How many more entries to read now: never more than admission limit + prefetch held,
        and none while the bulk sink holds ``bulk_buffer_limit`` results that are not durable yet."""
        if self.bulk.full():
            return 0
        by_pel = self.settings.max_num_seqs + self.settings.prefetch - self.state.num_held()
        by_engine = self.engine.num_admittable() + self.settings.prefetch - self.jobs.num_buffered()
        return max(0, min(by_pel, by_engine))

    def pull(self, block: bool, busy: bool, before: Callable[[], None] = lambda: None) -> int:
        """Reclaim (every ``reclaim_every_s``) and read up to ``capacity()`` entries; returns how many.

        ``before`` runs first, in the same Redis error handling. If Redis is unavailable
        while the worker is ``busy``, pulls pause with a backoff and the loop keeps stepping
        the jobs it has (the publisher thread retries their writes); otherwise it raises.
        """
        now = time.monotonic()
        if now < self._pull_paused_until:
            return 0
        try:
            before()
            if self.engine.has_unfinished_requests():
                # The engine is stepping: read the lanes at most every busy_pull_interval_ms, and while
                # it has no room (a read could only fill the prefetch) at most every FULL_PULL_INTERVAL_S.
                # Each read is a few round trips on the loop thread, which wait for the GIL too.
                interval = self.settings.busy_pull_interval_ms / 1000
                if self.engine.num_admittable() <= 0:
                    interval = max(interval, FULL_PULL_INTERVAL_S)
                if now < self._last_busy_pull + interval:
                    return 0
                self._last_busy_pull = now
            n = self._pull(block)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if not busy:
                raise  # nothing to step: the run loop backs off
            delay = self._pull_backoff.next()
            log.warning("redis unavailable while pulling (%s); stepping on, next pull in %.1fs", exc, delay)
            self._pull_paused_until = time.monotonic() + delay
            return 0
        self._pull_backoff.reset()
        return n

    def _pull(self, block: bool) -> int:
        want = self.capacity()
        if want <= 0:
            return 0
        deliveries: list[Delivery] = []
        now = time.monotonic()
        if now >= self._next_reclaim:
            self._next_reclaim = now + self.settings.reclaim_every_s
            deliveries = self.consumer.reclaim(want)
            if len(deliveries) < want:  # a read whose reply a dropped connection lost: ours, unknown to us
                known = set(self.state.held()) | self.bulk.pending() | {(d.lane, d.entry_id) for d in deliveries}
                deliveries += self.consumer.recover_unknown(known, want - len(deliveries))
        if len(deliveries) < want:
            block_ms = self.settings.block_ms if block and not deliveries else None
            deliveries += self.consumer.read(want - len(deliveries), block_ms=block_ms)
        # A burst is taken in chunks, each admitted before the next is parsed: the engine starts on
        # the first jobs while the rest are still being checked.
        for start in range(0, len(deliveries), ACCEPT_CHUNK):
            self.accept(deliveries[start:start + ACCEPT_CHUNK])
            self.admit()
        return len(deliveries)

    def recover(self) -> None:
        """Entries left in this consumer's PEL by an earlier process with the same name."""
        want = self.capacity()
        if want > 0:
            ds = self.consumer.recover_own(want)
            if ds:
                log.info("recovered %d entries from our own PEL", len(ds))
                self.accept(ds)

    def accept(self, deliveries: list[Delivery]) -> None:
        """Validate pulled entries; queue runnable ones in the buffer, finish the rest at once."""
        ops: list[object] = []
        ready: list[ActiveJob] = []
        for d in deliveries:
            self.state.hold((d.lane, d.entry_id))
            try:
                a = self._check_entry(d, ops)
            except Exception as exc:  # whatever one entry does, it fails alone: the batch and the loop go on
                log.exception("entry %s/%s could not be processed", d.lane, d.entry_id)
                ops.extend(self.results.reject(d, f"entry could not be processed: {type(exc).__name__}: {exc}"))
                continue
            if a is not None:
                ready.append(a)
        if ready:
            try:
                ops.extend(self._check_state(ready))
            except redis.RedisError:
                # Not started: stop holding them, so their leases lapse and they are reclaimed.
                self.state.unhold((a.delivery.lane, a.delivery.entry_id) for a in ready)
                ids = {id(a) for a in ready}
                self.jobs.keep_buffered(lambda a: id(a) not in ids)
                self.put(ops)
                raise
        self.put(ops)

    def _check_entry(self, d: Delivery, ops: list[object]) -> ActiveJob | None:
        if d.fields is None:  # deleted from the stream while pending
            ops.append(Ack(d.lane, [d.entry_id]))
            return None
        try:
            job = parse_delivery(d, self.settings.max_entry_bytes)
        except InvalidJob as exc:
            ops.extend(self.results.reject(d, str(exc)))
            return None
        if d.deliveries > self.settings.max_deliveries:
            ops.extend(self.results.reject(d, f"failed {d.deliveries - 1} deliveries (max_deliveries={self.settings.max_deliveries})", job))
            return None
        mine = self.jobs.find(job.job_id)
        if mine is not None:
            if (mine.delivery.lane, mine.delivery.entry_id) != (d.lane, d.entry_id):
                ops.append(Ack(d.lane, [d.entry_id]))  # a second entry for a job this worker already runs
            return None
        return ActiveJob(d, job)

    def _check_state(self, jobs: list[ActiveJob]) -> list[object]:
        """One round trip for the job hashes: skip finished/cancelled jobs, expire late ones, find resumes."""
        ops: list[object] = []
        if self.consumer.layout.sharded:  # Redis Cluster: also settle which entry is the job's own
            states = claim_entries(self.redis, jobs)
        else:
            pipe = self.redis.pipeline(transaction=False)
            for a in jobs:
                job_hash.queue_intake_read(pipe, keys.job_hash(a.job_id))
            states = [(status, cancel_requested, True) for status, cancel_requested in pipe.execute()]
        resume_from: list[ActiveJob] = []
        now = time.time()
        for a, (status, cancel_requested, own_entry) in zip(jobs, states):
            st = job_hash.status_of(status)
            a.has_job_hash = st is not None
            if not own_entry:  # a second entry of a job whose submit was retried on a cluster: the other one runs
                ops.append(Ack(a.delivery.lane, [a.delivery.entry_id]))
                continue
            if not a.is_bulk and st is not None and st.is_final:
                ops.append(Ack(a.delivery.lane, [a.delivery.entry_id]))
                continue
            if not a.is_bulk and cancel_requested:
                ops.append(self.results.finish(a, JobStatus.CANCELLED, error="cancelled"))
                continue
            if a.job.is_expired(now):
                ops.append(self.results.finish(a, JobStatus.EXPIRED, error=f"deadline passed {now - a.job.deadline:.3f}s before it started"))
                continue
            try:
                a.params = _sampling_params(a.job)
            except (ValueError, TypeError) as exc:
                ops.extend(self.results.reject(a.delivery, f"invalid sampling parameters: {exc}", a.job, ErrorCode.INVALID_INPUT))
                continue
            if st == JobStatus.RUNNING and not a.is_bulk:
                resume_from.append(a)
            self.jobs.buffer(a)
        if resume_from:
            load_history(self.redis, resume_from)
        return ops

    def admit(self) -> None:
        """Move buffered jobs into the engine as far as it can admit them now."""
        if not self.jobs.num_buffered():
            return
        n = self.engine.num_admittable()
        ops: list[object] = []
        skipped: list[ActiveJob] = []
        now = time.time()
        while (a := self.jobs.next_buffered()) is not None:
            if a.is_bulk and not self.bulk.is_live(a.job):
                self.jobs.pop_buffered()
                self.metrics.jobs.labels(JobStatus.CANCELLED.value).inc()
                ops.append(self.bulk.skip(a, self.settings.consumer))
                skipped.append(a)
                continue
            if n <= 0:
                break
            a = self.jobs.pop_buffered()
            if a.job.is_expired(now):
                ops.append(self.results.finish(a, JobStatus.EXPIRED, error="deadline passed before it started"))
                continue
            if not self._add_to_engine(a, ops):
                continue
            a.started_at = time.time()
            self.jobs.start(a)
            n -= 1
            if not a.is_bulk:
                ops.append(Start(a.job_id, self.settings.consumer, a.started_at, a.delivery.deliveries, a.job.result_ttl_s,
                                 created_at=a.job.created_at, model=self.settings.served_model_name or self.settings.model,
                                 first_token=not a.tokens_published, reclaimed_from=a.delivery.claimed_from,
                                 resumed_from=len(a.resume or [])))
        self.put(ops)
        if skipped:
            self.bulk.record_skipped(skipped)

    def _add_to_engine(self, a: ActiveJob, ops: list[object]) -> bool:
        j = a.job
        kw = dict(params=a.params, resume_token_ids=a.resume, priority=j.priority)
        if j.truncate_prompt_tokens is not None:  # only when set: an engine without truncation still serves the rest
            kw.update(truncate_prompt_tokens=j.truncate_prompt_tokens, truncation_side=j.truncation_side)
        try:
            if j.messages is not None:
                if j.tools:
                    kw["tools"] = j.tools
                # vLLM's chat-template options, only those the job sets (an engine without them still serves the rest)
                for name in ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs"):
                    if getattr(j, name) is not None:
                        kw[name] = getattr(j, name)
                self.engine.add_chat_request(j.job_id, [m.model_dump(exclude_none=True) for m in j.messages], **kw)
            elif j.prompt_token_ids is not None:
                self.engine.add_request(j.job_id, prompt_token_ids=j.prompt_token_ids, **kw)
            else:
                self.engine.add_request(j.job_id, prompt=j.prompt, **kw)
        except ValueError as exc:
            op = self.results.refuse(a, f"rejected by the engine: {exc}")
            if op is not None:
                ops.append(op)
            return False
        except EngineDeadError:
            raise  # not this job's fault: the worker exits and its jobs go to other workers
        except Exception as exc:  # an engine bug on this input: the job fails, the worker goes on
            log.exception("add_request(%s) failed", j.job_id)
            ops.extend(self.results.reject(a.delivery, f"the engine could not take this job: {type(exc).__name__}: {exc}", j))
            return False
        return True

    def drop(self, lost: set[Entry], cancels: set[str]) -> list[object]:
        """Buffered jobs whose lease another consumer took (dropped) or that were cancelled (finished)."""
        ops: list[object] = []

        def keep(a: ActiveJob) -> bool:
            if (a.delivery.lane, a.delivery.entry_id) in lost:
                return False
            if a.job_id in cancels:
                ops.append(self.results.finish(a, JobStatus.CANCELLED, error="cancelled"))
                return False
            return True

        self.jobs.keep_buffered(keep)
        return ops

    def take_buffer(self) -> list[Delivery]:
        """Empty the buffer (a stop): the deliveries to hand back."""
        return [a.delivery for a in self.jobs.take_buffered()]


def _sampling_params(job: JobRequest) -> Any:
    from pagestream.engine.sampling_params import SamplingParams

    return SamplingParams(**job.sampling.engine_kwargs())
