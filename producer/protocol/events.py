"""The job-event firehose ``ps:events``: one capped stream of lifecycle events (issue 27).

This module is the contract between those who write events (the client's submit and cancel, the
worker's start / final / dead-letter writes, the bulk sink; each in the same transaction as the state
change it reports) and those who read them (``Producer.events()``, ``pagestream events``, the webhook
consumer, the gateway's dashboard). An entry's fields are flat strings:

- ``type``: one of ``EventType``;
- ``job``: the job id (bulk and batch events: empty);
- ``ts``: epoch seconds when the change happened;
- then, where they apply: ``model``, ``lane``, ``tenant``, ``worker``, ``finish_reason``, ``tokens`` (output tokens),
  ``queue_s`` / ``run_s`` (seconds queued / running), ``error``, ``bulk`` (bulk id), ``batch`` (batch id),
  ``done`` / ``failed`` / ``total`` (bulk progress counts), ``deliveries``.
"""
from __future__ import annotations

import enum


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
    ERROR = "error"
    BULK = "bulk"
    BATCH = "batch"
    DONE = "done"
    FAILED = "failed"
    TOTAL = "total"
    DELIVERIES = "deliveries"
