"""Reading and retrying the dead-letter stream (``pagestream dlq list|show|retry``); no torch here.

A dead letter is an entry of ``keys.dead_letter_stream()``: a ``meta`` field (``DeadLetter``
JSON: lane, job id, reason, deliveries) and the lane entry's own fields as ``payload:<name>``.
Retrying one puts the job back on its lane under the same job id: its failed result and
token stream are deleted first (a reader then sees the new run, not the old failure), the
job is submitted again with the producer's script, and the dead letter is deleted last, so
a retry cut short by a crash can simply be run again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.schema import DeadLetter, JobRequest, format_validation_error
from pagestream.producer.protocol.wire import JOB_FIELD
from pagestream.producer.protocol.wire import as_str

_PAYLOAD = "payload:"


class DeadLetterNotFound(KeyError):
    """No dead letter with this entry id."""


class NotRetryable(ValueError):
    """The dead letter's payload cannot be submitted again (truncated, not a job, invalid)."""


@dataclass(slots=True)
class DeadLetterEntry:
    dlq_id: str
    meta: DeadLetter | None
    payload: dict[str, bytes]
    truncated: str | None

    def summary(self) -> dict[str, Any]:
        m = self.meta
        return {
            "dlq_id": self.dlq_id,
            "job_id": m.job_id if m else None,
            "lane": m.lane if m else None,
            "reason": m.reason if m else "(no meta)",
            "deliveries": m.deliveries if m else None,
            "worker": m.worker if m else None,
            "at": m.at if m else None,
            "truncated": self.truncated is not None,
        }

    def to_json(self) -> dict[str, Any]:
        out = self.summary()
        out["payload"] = {k: v.decode("utf-8", "replace") for k, v in self.payload.items()}
        if self.truncated:
            out["truncated_detail"] = self.truncated
        return out


def _s(v: Any) -> str:
    return str(as_str(v, "replace"))


def _entry(entry_id: Any, fields: dict) -> DeadLetterEntry:
    meta = None
    raw_meta = fields.get(b"meta") or fields.get("meta")
    if raw_meta is not None:
        try:
            meta = DeadLetter.model_validate_json(raw_meta)
        except ValidationError:
            meta = None
    payload = {}
    for k, v in fields.items():
        name = _s(k)
        if name.startswith(_PAYLOAD):
            payload[name[len(_PAYLOAD):]] = v if isinstance(v, bytes) else str(v).encode()
    truncated = fields.get(b"truncated") or fields.get("truncated")
    return DeadLetterEntry(_s(entry_id), meta, payload, _s(truncated) if truncated is not None else None)


def list_dead_letters(client: redis.Redis, count: int = 20) -> list[DeadLetterEntry]:
    """The newest ``count`` dead letters, newest first."""
    return [_entry(i, f) for i, f in client.xrevrange(keys.dead_letter_stream(), count=count)]


def get_dead_letter(client: redis.Redis, dlq_id: str) -> DeadLetterEntry:
    try:
        rows = client.xrange(keys.dead_letter_stream(), min=dlq_id, max=dlq_id)
    except redis.ResponseError as exc:  # not a stream id at all
        raise DeadLetterNotFound(f"no dead letter {dlq_id} ({exc})") from None
    if not rows:
        raise DeadLetterNotFound(f"no dead letter {dlq_id}")
    return _entry(*rows[0])


def retry_dead_letter(client: redis.Redis, dlq_id: str) -> str:
    """Submit the dead letter's job again (same job id, same lane); returns the job id."""
    from pagestream.producer import Producer

    entry = get_dead_letter(client, dlq_id)
    if entry.truncated is not None:
        raise NotRetryable(f"dead letter {dlq_id} kept only part of its entry ({entry.truncated}); it cannot be retried")
    raw = entry.payload.get(JOB_FIELD)
    if raw is None:
        raise NotRetryable(f"dead letter {dlq_id} has no '{JOB_FIELD}' field; it is not a job")
    try:
        job = JobRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise NotRetryable(f"dead letter {dlq_id} is not a valid job: {format_validation_error(exc)}") from None
    client.delete(keys.job_hash(job.job_id), keys.out_stream(job.job_id))
    Producer(client).submit(job, queue_unserved=True)
    client.xdel(keys.dead_letter_stream(), dlq_id)
    return job.job_id
