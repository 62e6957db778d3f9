"""Bulk dataset generation: the Python API web backends call.

A bulk is one RQ job (``producer.bulk.orchestrator.run_bulk``, queue
``pagestream-bulk``, JSON serializer) that streams an OpenAI-batch JSONL input
into lane jobs whose output target is the bulk, waits for the workers' part
files, and compacts them into ``output-NNNNN.jsonl`` / ``errors-NNNNN.jsonl``
shards plus ``manifest.json``.

>>> bulk_id = submit_bulk("s3://in/prompts.jsonl", "s3://out/run1", redis_url="redis://localhost:6379/0")
>>> get_bulk(redis.Redis.from_url(url, decode_responses=True), bulk_id)["status"]
'in_progress'

Its bookkeeping lives in the status hash ``ps:bulk:{<id>}`` (see ``producer/protocol/keys.py``).
"""
from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import redis

from pagestream.producer.protocol import keys
from pagestream.producer.bulk.rq_queue import BULK_QUEUE, RUN_BULK_FUNC, bulk_queue, fetch_job_status, rq_connection
from pagestream.producer.protocol.events import bulk_finished_fields, events_maxlen, queue_event
from pagestream.producer.protocol.redis_conn import connect, is_cluster
from pagestream.producer.protocol.bulk import AddressingStyle, BulkField, BulkSpec, BulkStatus, is_live, request_counts  # noqa: F401 (re-exported)
from pagestream.producer.protocol.bulk import decode as decode_bulk
from pagestream.producer.protocol.schema import Lane
from pagestream.producer.protocol.wire import as_str

#: orchestrator lease: a dead orchestrator's bulk is picked up again this long after its last heartbeat
LEASE_S = float(os.environ.get("PAGESTREAM_BULK_LEASE_S", "15"))
#: re-enqueues of a bulk whose orchestrator keeps dying before the bulk is failed
MAX_RESTARTS = 20


def new_bulk_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def enqueue_run(conn: redis.Redis, bulk_id: str, *, job_id: str | None = None, queue_name: str = BULK_QUEUE) -> str:
    """Enqueue the orchestration job of ``bulk_id`` on RQ; returns the RQ job id."""
    from rq import Retry

    queue = bulk_queue(rq_connection(conn), queue_name)
    job = queue.enqueue(
        RUN_BULK_FUNC,
        bulk_id,
        job_id=job_id or bulk_id,
        job_timeout=-1,  # a bulk runs as long as it takes; leases, not timeouts, detect a dead one
        result_ttl=7 * 24 * 3600,
        failure_ttl=7 * 24 * 3600,
        retry=Retry(max=3),
        meta={"bulk_id": bulk_id},
        description=f"pagestream bulk {bulk_id}",
    )
    conn.hset(keys.bulk_hash(bulk_id), BulkField.RQ_JOB_ID, job.id)
    return job.id


def create_bulk(
    input: str,
    output: str,
    *,
    connection: redis.Redis,
    model: str | None = None,
    lane: Lane | str = Lane.LOW,
    shard_lines: int = 10_000,
    max_outstanding: int = 2_048,
    completion_window_s: float | None = None,
    s3_endpoint_url: str | None = None,
    s3_region: str | None = None,
    s3_addressing_style: AddressingStyle | None = None,
    bulk_id: str | None = None,
    endpoint: str | None = None,
    input_file_id: str | None = None,
    metadata: dict[str, str] | None = None,
    served_models_only: bool = False,
    tool_call_parser: str | None = None,
) -> str:
    """Write a bulk's status hash (status ``validating``) without enqueueing it; returns the bulk id.

    For backends that enqueue RQ jobs themselves:
    ``bulk_queue(conn).enqueue(RUN_BULK_FUNC, bulk_id, job_timeout=-1)``.
    """
    # The orchestrator runs elsewhere (another cwd): pin relative local paths now.
    input, output = (u if "://" in u else os.path.abspath(u) for u in (input, output))
    spec = BulkSpec(
        bulk_id=bulk_id or new_bulk_id(), input=input, output=output, model=model, lane=Lane(lane),
        shard_lines=shard_lines, max_outstanding=max_outstanding, completion_window_s=completion_window_s,
        s3_endpoint_url=s3_endpoint_url, endpoint=endpoint, input_file_id=input_file_id, metadata=metadata,
        s3_region=s3_region, s3_addressing_style=s3_addressing_style, served_models_only=served_models_only,
        tool_call_parser=tool_call_parser,
    )
    key = keys.bulk_hash(spec.bulk_id)
    if not connection.hsetnx(key, BulkField.SPEC, spec.model_dump_json()):
        raise ValueError(f"bulk {spec.bulk_id} already exists")
    pipe = connection.pipeline()
    pipe.hset(key, mapping={BulkField.STATUS: BulkStatus.VALIDATING.value, BulkField.CREATED_AT: repr(spec.created_at),
                            BulkField.LINE: 0, BulkField.OFFSET: 0, BulkField.SUBMITTED: 0, BulkField.INVALID: 0, BulkField.COMPLETED: 0, BulkField.FAILED: 0})
    pipe.zadd(keys.bulk_index(), {spec.bulk_id: spec.created_at})
    pipe.execute()
    return spec.bulk_id


def submit_bulk(
    input: str,
    output: str,
    *,
    redis_url: str | None = None,
    connection: redis.Redis | None = None,
    queue_name: str = BULK_QUEUE,
    **options: Any,
) -> str:
    """Create a bulk and enqueue its orchestration job on RQ; returns the bulk id.

    ``input`` is a local path, ``file://`` URI or ``s3://bucket/key``; ``output`` a
    local directory, ``file://`` URI or ``s3://bucket/prefix``. ``options`` are
    ``create_bulk``'s (model, lane, shard_lines, max_outstanding,
    completion_window_s, s3_endpoint_url, s3_region, s3_addressing_style, bulk_id, and tool_call_parser: how
    ``tool_choice: auto`` lines' calls are read, vLLM run-batch's ``--tool-call-parser``). Nothing is read here: the
    orchestrator validates both (status ``validating``) and fails the bulk with a
    clear error if either is unusable.
    """
    if connection is None:
        if redis_url is None:
            raise ValueError("pass redis_url or connection")
        connection = connect(redis_url, decode_responses=True)
    bulk_id = create_bulk(input, output, connection=connection, **options)
    enqueue_run(connection, bulk_id, queue_name=queue_name)
    return bulk_id


def load_spec(conn: redis.Redis, bulk_id: str) -> BulkSpec:
    raw = conn.hget(keys.bulk_hash(bulk_id), BulkField.SPEC)
    if raw is None:
        raise KeyError(f"no bulk {bulk_id!r}")
    return BulkSpec.model_validate_json(as_str(raw))


def queue_finished_event(conn: Any, pipe: Any, bulk_id: str, status: BulkStatus, counts: dict[str, int],
                         batch: str | None = None, error: str | None = None, ts: float | None = None) -> dict | None:
    """Queue the bulk's one ``bulk_finished`` event on ``pipe``, the transaction that makes its status final. On a
    cluster the events stream is in another slot: the fields are returned, for ``write_late_event`` after it."""
    fields = bulk_finished_fields(bulk_id, time.time() if ts is None else ts, status.value, counts, batch, error)
    if is_cluster(conn):
        return fields
    queue_event(pipe, fields, events_maxlen())
    return None


def write_late_event(conn: Any, fields: dict | None) -> None:
    """The event ``queue_finished_event`` left for after the transaction (Redis Cluster), if any."""
    if fields is not None:
        queue_event(conn, fields, events_maxlen())


def _batch_of(conn: redis.Redis, bulk_id: str) -> str | None:
    try:
        return load_spec(conn, bulk_id).batch_id
    except (KeyError, ValueError):
        return None


def get_bulk(conn: redis.Redis, bulk_id: str) -> dict[str, Any]:
    """Status of a bulk as a JSON-able dict (OpenAI batch-like). Raises ``KeyError`` if unknown."""
    state = decode_bulk(conn.hgetall(keys.bulk_hash(bulk_id)))
    if not state or BulkField.SPEC not in state:
        raise KeyError(f"no bulk {bulk_id!r}")
    spec = BulkSpec.model_validate_json(state[BulkField.SPEC])
    out: dict[str, Any] = {
        "id": bulk_id,
        "object": "batch",
        "status": state.get(BulkField.STATUS),
        "input": spec.input,
        "output": spec.output,
        "model": spec.model,
        "created_at": float(state[BulkField.CREATED_AT]) if state.get(BulkField.CREATED_AT) else None,
        "finished_at": float(state[BulkField.FINISHED_AT]) if state.get(BulkField.FINISHED_AT) else None,
        "request_counts": request_counts(state),
        "lines_read": int(state.get(BulkField.LINE, 0) or 0),
        "input_done": state.get(BulkField.INPUT_DONE) == "1",
        "rq_job_id": state.get(BulkField.RQ_JOB_ID),
        "error": state.get(BulkField.ERROR),
        "manifest": state.get(BulkField.MANIFEST),
    }
    # a part write that failed once and then went through is history once the bulk completed
    if state.get(BulkField.SINK_ERROR) and out["status"] != BulkStatus.COMPLETED.value:
        out["sink_error"] = state[BulkField.SINK_ERROR]
    return out


def cancel_bulk(conn: redis.Redis, bulk_id: str, pipeline: redis.client.Pipeline | None = None) -> str:
    """Ask the orchestrator to stop feeding and finalize what is done; returns the resulting status.

    With ``pipeline`` the write is queued there (the caller executes it)."""
    key = keys.bulk_hash(bulk_id)
    if not conn.exists(key):
        raise KeyError(f"no bulk {bulk_id!r}")
    status = BulkStatus(as_str(conn.hget(key, BulkField.STATUS)))
    if status.is_final:
        return status.value
    pipe = pipeline if pipeline is not None else conn.pipeline()
    pipe.hset(key, mapping={BulkField.CANCEL_REQUESTED: repr(time.time()), BulkField.STATUS: BulkStatus.CANCELLING.value})
    if pipeline is None:
        pipe.execute()
    return BulkStatus.CANCELLING.value


def bulk_is_live(conn: redis.Redis, bulk_id: str) -> bool:
    """False once a bulk is final or cancelling: a worker may skip (or drop results of) its queued jobs."""
    return is_live(conn, keys.bulk_hash(bulk_id))


def list_bulks(conn: redis.Redis, limit: int = 100) -> list[str]:
    return [as_str(x) for x in conn.zrevrange(keys.bulk_index(), 0, limit - 1)]


def rescue_stalled(conn: redis.Redis, queue_name: str = BULK_QUEUE) -> list[str]:
    """Re-enqueue bulks whose orchestrator died (lease expired, no RQ job waiting); returns their ids.

    ``pagestream bulk-worker`` calls this at start and every few seconds, so a
    ``kill -9`` of the RQ worker running a bulk costs one lease period, not the bulk.
    """
    from rq.job import JobStatus

    rescued = []
    for bulk_id in list_bulks(conn, limit=1000):
        key = keys.bulk_hash(bulk_id)
        status, rq_job_id = conn.hmget(key, BulkField.STATUS, BulkField.RQ_JOB_ID)
        if status is None or BulkStatus(as_str(status)).is_final:
            continue
        if conn.exists(keys.bulk_lock(bulk_id)):
            continue  # an orchestrator holds the lease
        if rq_job_id:
            st = fetch_job_status(conn, as_str(rq_job_id))
            if st in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
                continue
            if st == JobStatus.STARTED and time.time() - _heartbeat_at(conn, bulk_id) < LEASE_S:
                continue  # just started, has not taken the lease yet
        if not conn.set(keys.bulk_rescue_marker(bulk_id), "1", nx=True, ex=30):
            continue
        n = conn.hincrby(key, BulkField.RESTARTS, 1)
        if n > MAX_RESTARTS:
            now, error = time.time(), f"orchestrator died or failed {n - 1} times; giving up"
            counts = request_counts(decode_bulk(conn.hgetall(key)))
            pipe = conn.pipeline(transaction=True)
            pipe.hset(key, mapping={BulkField.STATUS: BulkStatus.FAILED.value, BulkField.FINISHED_AT: repr(now),
                                    BulkField.ERROR: error})
            late = queue_finished_event(conn, pipe, bulk_id, BulkStatus.FAILED, counts, _batch_of(conn, bulk_id), error, now)
            pipe.execute()
            write_late_event(conn, late)
            continue
        enqueue_run(conn, bulk_id, job_id=f"{bulk_id}-r{n}", queue_name=queue_name)
        rescued.append(bulk_id)
    return rescued


def _heartbeat_at(conn: redis.Redis, bulk_id: str) -> float:
    return float(as_str(conn.hget(keys.bulk_hash(bulk_id), BulkField.HEARTBEAT_AT) or 0))


def dumps_status(status: dict[str, Any]) -> str:
    return json.dumps(status, indent=2, sort_keys=True)
