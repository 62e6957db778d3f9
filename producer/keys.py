"""Every Redis key name pagestream uses, built in one place.

Keys that belong to one job share the hash tag ``{job_id}`` so all of a job's
keys land in one slot on Redis Cluster. Lane streams and the dead-letter stream
are shared by many jobs and carry no job tag. All keys of one bulk share the
hash tag ``{bulk_id}`` so a bulk's bookkeeping lands in one slot and the bulk
sink's Lua script may touch them together.
"""
from __future__ import annotations

PREFIX = "ps"

#: the consumer group every worker joins on each lane stream
DEFAULT_GROUP = "workers"

#: lanes in the order workers read them: high before normal before low
LANES: tuple[str, ...] = ("high", "normal", "low")


def jobs_stream(lane: str, model: str | None = None) -> str:
    """Stream of submitted jobs for one priority lane: the shared one, or one model's (routing by model)."""
    if model is None:
        return f"{PREFIX}:jobs:{lane}"
    return f"{PREFIX}:jobs:m:{model}:{lane}"


def model_registry() -> str:
    """Sorted set: model name -> unix ms until which some worker announced it serves that model."""
    return f"{PREFIX}:models"


def model_info() -> str:
    """Hash: model name -> JSON of what its workers announced (``max_model_len``)."""
    return f"{PREFIX}:models:info"


def dead_letter_stream() -> str:
    """Copies of jobs that were invalid or failed ``max_deliveries`` deliveries."""
    return f"{PREFIX}:dlq"


def cancel_stream() -> str:
    """Cancellation requests; every worker reads it (no group) to stop running jobs."""
    return f"{PREFIX}:cancels"


def job_hash(job_id: str) -> str:
    """Hash with a job's status, request, result and timings (expires after the result TTL)."""
    return f"{PREFIX}:job:{{{job_id}}}"


def out_stream(job_id: str) -> str:
    """Per-job stream of token events followed by one ``end`` event."""
    return f"{PREFIX}:out:{{{job_id}}}"


def done_counter(lane: str, epoch_s: int) -> str:
    """Jobs finished in one wall-clock second on a lane (for jobs/s in ``pagestream stats``)."""
    return f"{PREFIX}:rate:{lane}:{epoch_s}"


def worker_hash(consumer: str) -> str:
    """A live worker's engine stats (running, free KV blocks...), refreshed every second, short TTL."""
    return f"{PREFIX}:worker:{consumer}"


def bench_stream(name: str) -> str:
    """Scratch stream ``bench/queue_overhead.py`` XADDs to for its Redis floor (deleted after each run)."""
    return f"{PREFIX}:bench:{name}"


# ---- bulk path (producer.bulk, producer.bulk_orchestrator, worker.bulk_sink) ----
def bulk_hash(bulk_id: str) -> str:
    """Status hash: status, spec, checkpoint (line, offset), request counts, error."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}"


def bulk_done_set(bulk_id: str) -> str:
    """custom_ids whose result is in a durable part file (counted exactly once)."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}:done"


def bulk_seen_hash(bulk_id: str) -> str:
    """custom_id -> input line that first used it (duplicate detection, resume-safe)."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}:seen"


def bulk_lock(bulk_id: str) -> str:
    """Lease of the one orchestrator running the bulk (a random token, PX expiry)."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}:lock"


def bulk_rescue_marker(bulk_id: str) -> str:
    """Short-lived marker so two bulk workers do not both re-enqueue a stalled bulk."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}:rescue"


def bulk_part_seq(bulk_id: str) -> str:
    """Counter for part file sequence numbers (unique across worker restarts)."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}:partseq"


def bulk_index() -> str:
    """Sorted set of all bulk ids by creation time."""
    return f"{PREFIX}:bulks"


# ---- OpenAI files (producer.batches: /v1/files in the gateway) ----
def file_hash(file_id: str) -> str:
    """An uploaded (or batch output) file's record: name, bytes, purpose, where its content lives."""
    return f"{PREFIX}:file:{{{file_id}}}"


def files_index() -> str:
    """Sorted set of file ids by creation time."""
    return f"{PREFIX}:files"
