"""Redis key names of the bulk path.

These belong in ``producer/keys.py`` (the one module for key names); they live
here until the queue owner moves them. All keys of one bulk share the hash tag
``{bulk_id}`` so a bulk's bookkeeping lands in one Redis Cluster slot and the
sink's Lua script may touch them together.
"""
from __future__ import annotations

PREFIX = "ps"


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
