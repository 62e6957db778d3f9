"""Every Redis key name pagestream uses, built in one place.

Keys that belong to one job share the hash tag ``{job_id}`` so all of a job's
keys land in one slot on Redis Cluster. Lane streams and the dead-letter stream
are shared by many jobs and carry no job tag.
"""
from __future__ import annotations

PREFIX = "ps"

#: the consumer group every worker joins on each lane stream
DEFAULT_GROUP = "workers"

#: lanes in the order workers read them: high before normal before low
LANES: tuple[str, ...] = ("high", "normal", "low")


def jobs_stream(lane: str) -> str:
    """Stream of submitted jobs for one priority lane."""
    return f"{PREFIX}:jobs:{lane}"


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
