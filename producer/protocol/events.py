"""The job-event firehose ``ps:events``: one capped stream of lifecycle events (issue 27).

This module is the contract between those who write events (the client's submit and cancel, the
worker's start / first-token / final / dead-letter writes, the bulk sink; each in the same transaction as the state
change it reports) and those who read them (``Producer.events()``, ``pagestream events``, the webhook
consumer, the gateway's dashboard). An entry's fields are flat strings:

- ``type``: one of ``EventType``;
- ``job``: the job id (bulk and batch events: empty);
- ``ts``: epoch seconds when the change happened;
- then, where they apply: ``model``, ``lane``, ``tenant``, ``worker``, ``finish_reason``, ``tokens`` (output tokens;
  on ``resumed``: the tokens an earlier delivery published, which the job continues from), ``queue_s`` / ``run_s``
  (seconds queued / running), ``ttft_s`` (seconds from submit to the first token, on ``first_token``), ``error``,
  ``bulk`` (bulk id), ``batch`` (batch id: a Batch API batch's, which is its bulk id), ``done`` / ``failed`` /
  ``total`` (bulk counts), ``status`` (a bulk's final status), ``from_worker`` (on ``reclaimed``: the consumer
  that held the entry), ``deliveries``.

``first_token`` is written once per job, by the worker's publisher, in the flush that writes the job's first token
entry (index 0, whichever sample has it first); a job resumed after a worker died writes it only if no token had
been published before. Bulk jobs (no out stream, no ``started``) write none.

``reclaimed`` and ``resumed`` go with the ``started`` of a delivery that took a job over: ``reclaimed`` just before
it, for an entry this worker took from another consumer's PEL (XAUTOCLAIM after the lease lapsed, or an entry a
stopping worker handed back) or found in its own PEL after a restart under the same name; ``resumed`` just after it,
when the job continues from tokens an earlier delivery published (``tokens`` says how many). A kill -9 mid-job reads
``queued, started, first_token, reclaimed, started, resumed, finished``; see ARCHITECTURE.md ("Job events").

``bulk_progress`` is written by the script that counts a committed part's lines (the bulk sink's part, or the
orchestrator's part of invalid input lines) when it changes the counts: ``done`` (lines answered, ok or not,
skipped included), ``failed`` (failed and invalid lines), ``total`` (lines read so far: the input's once it is all
read). ``bulk_finished`` is written once, with the bulk's final status: its final counts, ``status``, ``error``.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.schema import JobResult, JobStatus
from pagestream.producer.protocol.settings import ENV_PREFIX
from pagestream.producer.protocol.wire import as_str


class EventType(str, enum.Enum):
    QUEUED = "queued"
    STARTED = "started"
    FIRST_TOKEN = "first_token"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEAD_LETTERED = "dead_lettered"
    RECLAIMED = "reclaimed"
    RESUMED = "resumed"
    BULK_PROGRESS = "bulk_progress"
    BULK_FINISHED = "bulk_finished"


class EventField:
    TYPE = "type"
    JOB = "job"
    TS = "ts"
    MODEL = "model"
    LANE = "lane"
    TENANT = "tenant"
    WORKER = "worker"
    FINISH_REASON = "finish_reason"
    TOKENS = "tokens"
    QUEUE_S = "queue_s"
    RUN_S = "run_s"
    TTFT_S = "ttft_s"
    ERROR = "error"
    BULK = "bulk"
    BATCH = "batch"
    DONE = "done"
    FAILED = "failed"
    TOTAL = "total"
    DELIVERIES = "deliveries"
    STATUS = "status"
    FROM_WORKER = "from_worker"


#: the stream's approximate bound (``XADD MAXLEN ~``) unless ``PAGESTREAM_EVENTS_MAXLEN`` says otherwise
DEFAULT_EVENTS_MAXLEN = 100_000


class EventSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    events_maxlen: int = Field(DEFAULT_EVENTS_MAXLEN, ge=1)


@functools.cache
def events_maxlen() -> int:
    """``PAGESTREAM_EVENTS_MAXLEN``, else ``DEFAULT_EVENTS_MAXLEN`` (read once per process: a submit
    of 200k jobs asks it 200k times)."""
    return EventSettings().events_maxlen


def event_fields(type_: EventType, job: str, ts: float, **extra: Any) -> dict[str, str]:
    """An entry's fields: type, job, ts, then each extra that is not None, as strings."""
    fields = {EventField.TYPE: type_.value, EventField.JOB: job, EventField.TS: repr(float(ts))}
    fields.update({k: str(v) for k, v in extra.items() if v is not None})
    return fields


def queue_event(pipe: Any, fields: dict[str, str], maxlen: int) -> None:
    """Queue the XADD of one event on ``pipe`` (the transaction of the change it reports)."""
    pipe.xadd(keys.events_stream(), fields, maxlen=maxlen, approximate=True)


#: the event a job's final status is reported by (an expired job failed: its ``error`` says why)
FINAL_EVENT = {JobStatus.COMPLETED: EventType.FINISHED, JobStatus.FAILED: EventType.FAILED,
               JobStatus.CANCELLED: EventType.CANCELLED, JobStatus.EXPIRED: EventType.FAILED}


def final_event_fields(r: JobResult) -> dict[str, str]:
    """The event of a job's final result: its type by status, with model, worker, finish reason,
    output tokens, seconds queued and running, error and deliveries where known."""
    queue_s = r.started_at - r.created_at if r.started_at is not None and r.created_at is not None else None
    run_s = r.finished_at - r.started_at if r.started_at is not None else None
    error = r.error if r.error is not None or r.status != JobStatus.EXPIRED else "expired"
    return event_fields(FINAL_EVENT[r.status], r.job_id, r.finished_at, model=r.model, worker=r.worker,
                        finish_reason=r.finish_reason, tokens=r.completion_tokens,
                        queue_s=None if queue_s is None else round(queue_s, 6),
                        run_s=None if run_s is None else round(run_s, 6), error=error, deliveries=r.deliveries or None)


def first_token_fields(job: str, ts: float, since: float, worker: str | None = None,
                       model: str | None = None) -> dict[str, str]:
    """The event of a job's first token, published at ``ts``: ``ttft_s`` is counted from ``since`` (the job's
    submit time where known, else its start), with the worker and model that ran it where known."""
    return event_fields(EventType.FIRST_TOKEN, job, ts, model=model, worker=worker,
                        ttft_s=round(ts - since, 6))


def reclaimed_fields(job: str, ts: float, worker: str, from_worker: str | None, deliveries: int) -> dict[str, str]:
    """The event of a delivery that took a job over: who took it, from whom (where known), which delivery."""
    return event_fields(EventType.RECLAIMED, job, ts, worker=worker, from_worker=from_worker or None,
                        deliveries=deliveries)


def resumed_fields(job: str, ts: float, worker: str, tokens: int) -> dict[str, str]:
    """The event of a job that continues from ``tokens`` tokens an earlier delivery published."""
    return event_fields(EventType.RESUMED, job, ts, worker=worker, tokens=tokens)


def bulk_progress_fields(bulk: str, ts: float, done: int, failed: int, total: int,
                         batch: str | None = None) -> dict[str, str]:
    """A bulk's progress after a committed part (``COUNT_LUA`` writes the same fields on a single node)."""
    return event_fields(EventType.BULK_PROGRESS, "", ts, bulk=bulk, batch=batch or None, done=done, failed=failed,
                        total=total)


def bulk_finished_fields(bulk: str, ts: float, status: str, counts: dict[str, int], batch: str | None = None,
                         error: str | None = None) -> dict[str, str]:
    """A bulk's end: its final status and counts (``counts``: OpenAI's ``request_counts``, total / completed / failed)."""
    failed = int(counts.get("failed", 0))
    return event_fields(EventType.BULK_FINISHED, "", ts, bulk=bulk, batch=batch or None, status=status,
                        done=int(counts.get("completed", 0)) + failed, failed=failed, total=int(counts.get("total", 0)),
                        error=error or None)


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of the stream, as ``Producer.events()`` yields it."""

    id: str
    type: EventType | str  # a type this version does not know stays a string
    job: str
    ts: float
    fields: dict[str, str]

    @classmethod
    def parse(cls, entry_id: Any, raw: dict) -> Event:
        f = {as_str(k, "replace"): as_str(v, "replace") for k, v in raw.items()}
        t = f.get(EventField.TYPE, "")
        try:
            type_: EventType | str = EventType(t)
        except ValueError:
            type_ = t
        try:
            ts = float(f.get(EventField.TS, "0"))
        except ValueError:
            ts = 0.0
        return cls(as_str(entry_id), type_, f.get(EventField.JOB, ""), ts, f)
