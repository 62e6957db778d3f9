"""From engine outputs to what the publisher writes: token deltas, final results, dead letters.

``collect``, ``job_result`` and ``rejected_result`` are pure: they read engine outputs
and a job's own accumulated samples and return what to write. ``Results`` routes a
finished job: a ``Final`` for the publisher (result, status, ack in one transaction),
or the bulk sink for bulk jobs, which are acked only once their part is durable.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import redis

from pagestream.producer.protocol.schema import ErrorCode, JobRequest, JobResult, JobStatus, OutputTarget, SampleResult
from pagestream.worker.bulk_jobs import BulkJobs
from pagestream.worker.consumer import Consumer, Delivery
from pagestream.worker.job_table import JobTable
from pagestream.worker.jobs import ActiveJob, NoAckPipe, SampleOutput, salvage
from pagestream.worker.logprobs import TokenTexts
from pagestream.worker.loop_state import LoopState
from pagestream.worker.metrics import WorkerMetrics
from pagestream.worker.publisher import UNKNOWN_JOB_ID, Delta, Final, safe_text
from pagestream.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

_NO_TOKENIZER = TokenTexts()


def collect(outputs: list, jobs: JobTable, token_texts: TokenTexts | None = None
            ) -> tuple[list[Delta], list[tuple[ActiveJob, str | None]]]:
    """One step's deltas to publish, and the jobs that finished (with the engine's error, if any).

    A job that asked for logprobs gets them in wire form (tokens named by ``token_texts``)."""
    # Hot path (every step, every running job): plain attribute reads only.
    deltas: list[Delta] = []
    append = deltas.append
    finished: list[tuple[ActiveJob, str | None]] = []
    get = jobs.get
    for out in outputs:
        a = get(out.request_id)
        if a is None:
            continue
        if not a.prompt_tokens and out.prompt_token_ids:
            a.prompt_tokens = len(out.prompt_token_ids)
            if a.job.return_prompt_token_ids:
                a.prompt_token_ids = list(out.prompt_token_ids)
        if out.prompt_logprobs is not None:  # once, for a job that asked
            a.prompt_logprobs = (token_texts or _NO_TOKENIZER).encode_prompt(
                out.prompt_token_ids, out.prompt_logprobs, a.job.sampling.prompt_logprobs or 0)
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
            lps = None
            if c.logprobs is not None:  # the engine reports them only for jobs that asked
                lps = (token_texts or _NO_TOKENIZER).encode(ids, c.logprobs, a.job.sampling.logprobs or 0)
                s.logprobs.extend(lps)
            if not a.is_bulk:
                prompt_lps = None
                if a.prompt_logprobs is not None and a.job.stream_prompt_logprobs and not a.prompt_logprobs_streamed:
                    prompt_lps, a.prompt_logprobs_streamed = a.prompt_logprobs, True  # with the job's first event
                delta = Delta(a.job_id, c.index, c.first_token_index, ids, text, fin, lps, prompt_lps)
                if not c.first_token_index and ids:  # a first token: its time, for the job's first_token event
                    delta.at = time.time()
                if not a.first_delta_sent and a.prompt_tokens:  # a stream's usage and ids need them before the end
                    a.first_delta_sent = True
                    delta.prompt_tokens, delta.prompt_token_ids = a.prompt_tokens, a.prompt_token_ids
                append(delta)
        if out.finished:
            a.num_cached_tokens = out.num_cached_tokens
            finished.append((a, out.error))
    return deltas, finished


def job_result(a: ActiveJob, status: JobStatus, error: str | None, worker: str) -> JobResult:
    """The final result of a job that ran (or was stopped) in this worker."""
    wants_logprobs = a.job.sampling.logprobs is not None
    samples = [
        SampleResult(index=i, text="".join(s.text), token_ids=s.token_ids, finish_reason=s.finish_reason,
                     logprobs=s.logprobs if wants_logprobs else None)
        for i, s in sorted(a.samples.items())
    ]
    first = samples[0] if samples else None
    return JobResult(
        job_id=a.job_id,
        status=status,
        text=first.text if first else "",
        token_ids=first.token_ids if first else [],
        finish_reason=first.finish_reason if first else None,
        error=error,
        outputs=samples,
        prompt_tokens=a.prompt_tokens,
        num_cached_tokens=a.num_cached_tokens,
        completion_tokens=sum(len(s.token_ids) for s in samples),
        prompt_token_ids=a.prompt_token_ids,
        prompt_logprobs=a.prompt_logprobs,
        worker=worker,
        deliveries=a.delivery.deliveries,
        resumed_from=len(a.resume or []),
        created_at=a.job.created_at,
        started_at=a.started_at or None,
        metadata=a.job.metadata,
    )


def rejected_result(
    d: Delivery, reason: str, job: JobRequest | None, worker: str, max_entry_bytes: int, code: ErrorCode | None = None
) -> tuple[JobResult, str | None, OutputTarget | None, int]:
    """The failed result of an entry that cannot run: (result, job id if known, output target, TTL)."""
    job_id, output, ttl, meta = salvage(d, job, max_entry_bytes)
    result = JobResult(job_id=job_id or UNKNOWN_JOB_ID, status=JobStatus.FAILED, error=safe_text(reason), error_code=code,
                       worker=worker, deliveries=d.deliveries, metadata=meta)
    return result, job_id, output, ttl


class Results:
    """Turns finished jobs into publisher ops (or bulk sink entries), counting them in the metrics."""

    def __init__(self, client: redis.Redis, settings: WorkerSettings, consumer: Consumer, bulk: BulkJobs, state: LoopState,
                 metrics: WorkerMetrics) -> None:
        self.redis = client
        self.consumer = consumer
        self.settings = settings
        self.worker = settings.consumer
        self.bulk = bulk
        self.state = state
        self.metrics = metrics
        self.num_completed = 0
        # names the tokens of logprobs; the worker hands it the engine's tokenizer
        self.token_texts = TokenTexts()

    def publish(self, outputs: list, jobs: JobTable) -> list[object]:
        """Everything one engine step leaves to write; finished jobs leave the running ones in ``jobs``."""
        ops: list[object] = []
        deltas, finished = collect(outputs, jobs, self.token_texts)
        ops.extend(deltas)
        for a, error in finished:
            jobs.finish(a.job_id)
            if error:
                ops.extend(self.reject(a.delivery, f"engine error: {error}", a.job))
            else:
                ops.append(self.finish(a, JobStatus.COMPLETED))
                self.num_completed += 1
        return ops

    def finish(self, a: ActiveJob, status: JobStatus, error: str | None = None, code: ErrorCode | None = None) -> Any:
        """The op that ends a job (None: a bulk job, handed to the sink and acked once durable)."""
        self.metrics.jobs.labels(status.value).inc()
        result = job_result(a, status, error, self.worker)
        result.error_code = code
        # routing by model: the result names the model that served it, not the name asked for
        result.model = self.settings.served_model_name or self.settings.model
        entry = (a.delivery.lane, a.delivery.entry_id)
        if a.is_bulk:
            if self._to_sink(a.delivery, a.job, result):
                return None
            result = result.model_copy(update={"status": JobStatus.FAILED, "error": self.bulk.error})
            return Final(result, a.job.result_ttl_s, entry, dead_letter=a.delivery, write_result=False)
        return Final(result, a.job.result_ttl_s, entry)

    def refuse(self, a: ActiveJob, reason: str) -> Any:
        """A well-formed job whose input the engine refused (a prompt past the context): the request's
        fault, not a poison entry, so it fails as ``invalid_input`` with no copy in the DLQ."""
        return self.finish(a, JobStatus.FAILED, error=reason, code=ErrorCode.INVALID_INPUT)

    def reject(self, d: Delivery, reason: str, job: JobRequest | None = None, code: ErrorCode | None = None) -> list[object]:
        """An invalid or poison entry: failed result (if it names a job), copy to the DLQ, ack; ``code`` says
        when the request itself is the cause (``ErrorCode.INVALID_INPUT``: the gateway answers 400)."""
        log.info("dead-lettering %s/%s: %s", d.lane, d.entry_id, safe_text(reason[:500]))
        self.metrics.dead_letters.inc()
        self.metrics.jobs.labels(JobStatus.FAILED.value).inc()
        result, job_id, output, ttl = rejected_result(d, reason, job, self.worker, self.settings.max_entry_bytes, code)
        if output is not None and output.kind == "bulk":
            stub = job or JobRequest.model_construct(job_id=job_id or f"entry-{d.entry_id}", output=output, metadata=result.metadata)
            if self._to_sink(d, stub, result):
                # the sink acks it once durable; the DLQ still gets a copy
                self.consumer.dead_letter(d, result.error, job_id, pipeline=NoAckPipe(self.redis))
                return []
        return [Final(result, ttl, (d.lane, d.entry_id), dead_letter=d, write_result=job_id is not None)]

    def _to_sink(self, d: Delivery, job: JobRequest, result: JobResult) -> bool:
        if not self.bulk.to_sink(d, job, result):
            return False
        self.state.unhold([(d.lane, d.entry_id)])  # the sink's entries are bounded by bulk_buffer_limit instead
        return True
