"""How schema objects are laid out in Redis stream entries and hashes.

Token events are written by the worker once per coalesced delta, so they use
compact JSON built with ``json`` rather than pydantic (the hot path).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagestream.producer.protocol.schema import JobRequest, JobResult, JobStatus, TokenEvent
from pagestream.producer.protocol.untrusted import MAX_JSON_DEPTH, UntrustedJSONError, loads_untrusted  # noqa: F401 (re-exported)

#: field of a lane-stream entry holding the JobRequest JSON
JOB_FIELD = "job"
#: out-stream entry field naming the event type
TYPE_FIELD = "type"
_TYPE_FIELD_B = TYPE_FIELD.encode()
TOKEN_TYPE = "tok"
END_TYPE = "end"


def job_fields(job: JobRequest) -> dict[str, str]:
    return {JOB_FIELD: job.model_dump_json(exclude_none=True)}


def token_event_fields(sample: int, index: int, token_ids: list[int], text: str, finish_reason: str | None,
                       logprobs: list | None = None, prompt_logprobs: list | None = None,
                       prompt_tokens: int | None = None, prompt_token_ids: list[int] | None = None) -> dict[str, str]:
    """``logprobs``: one ``[token_id, token, logprob, [[id, token, logprob], ...]]`` per token id
    (``TokenLogprob``'s wire form), or None: an event without them is exactly what it was before;
    ``prompt_logprobs``: the same per prompt token, on a job's first event only (``stream_prompt_logprobs``), as are
    ``prompt_tokens`` (the prompt's size) and ``prompt_token_ids`` (``return_prompt_token_ids``)."""
    ev: dict[str, Any] = {"s": sample, "i": index, "t": token_ids, "x": text}
    if finish_reason is not None:
        ev["f"] = finish_reason
    if logprobs is not None:
        ev["l"] = logprobs
    if prompt_logprobs is not None:
        ev["p"] = prompt_logprobs
    if prompt_tokens is not None:
        ev["n"] = prompt_tokens
    if prompt_token_ids is not None:
        ev["pt"] = prompt_token_ids
    return {TYPE_FIELD: TOKEN_TYPE, "ev": json.dumps(ev, ensure_ascii=False, separators=(",", ":"))}


#: end-entry field: a completed job's usage and timings (compact JSON, see ``end_summary``), so a reader that
#: only needs those (the gateway's stream: usage chunk and vLLM's metrics) does not read the whole result
SUMMARY_FIELD = "u"
_SUMMARY_FIELD_B = SUMMARY_FIELD.encode()


def end_fields(status: str, result: JobResult | None = None) -> dict[str, str]:
    """The job's ``end`` entry: its status and, for a completed ``result``, its summary (an entry without one,
    as older workers write, is read as before: readers that need the usage read the result)."""
    fields = {TYPE_FIELD: END_TYPE, "status": status}
    if result is not None and result.status == JobStatus.COMPLETED:
        fields[SUMMARY_FIELD] = json.dumps({
            "pt": result.prompt_tokens, "ct": result.completion_tokens, "cc": result.num_cached_tokens,
            "c": result.created_at, "s": result.started_at, "f": result.finished_at,
            "r": [s.finish_reason for s in result.outputs]}, separators=(",", ":"))
    return fields


@dataclass(slots=True)
class SampleSummary:
    index: int
    finish_reason: str | None


@dataclass(slots=True)
class JobSummary:
    """What a completed job's end entry tells of its result (``JobResult``'s fields of the same names; no
    text, ids or logprobs): a plain object, built per stream without pydantic's per-instance work."""

    job_id: str
    prompt_tokens: int
    completion_tokens: int
    num_cached_tokens: int
    created_at: float | None
    started_at: float | None
    finished_at: float
    outputs: list[SampleSummary]
    status: JobStatus = JobStatus.COMPLETED

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None


def end_summary(job_id: str, fields: dict) -> JobSummary | None:
    """The completed job's summary its end entry carries (usage, timings, each sample's finish reason), or None
    when the entry has none (an older worker, a job not completed)."""
    raw = fields.get(_SUMMARY_FIELD_B, fields.get(SUMMARY_FIELD))
    if raw is None:
        return None
    try:
        u = json.loads(raw)
        return JobSummary(job_id, int(u["pt"]), int(u["ct"]), int(u["cc"]), u["c"], u["s"], float(u["f"]),
                          [SampleSummary(i, r) for i, r in enumerate(u["r"])])
    except (ValueError, TypeError, KeyError):  # not ours: the reader falls back to the result
        return None


def as_str(v: Any, errors: str = "strict") -> Any:
    """A Redis reply value as text: bytes decoded as UTF-8 (``errors`` as for ``bytes.decode``),
    anything else (str, None, a number) as it is. The one helper every reader of a reply uses."""
    return v.decode("utf-8", errors) if isinstance(v, bytes) else v


def is_end_entry(fields: dict) -> bool:
    """Whether an out-stream entry's fields (bytes or str keys) are the job's ``end`` entry."""
    t = fields.get(_TYPE_FIELD_B, fields.get(TYPE_FIELD))
    return t is not None and as_str(t) == END_TYPE


def decode_out_entry(job_id: str, fields: dict) -> TokenEvent | str:
    """A TokenEvent, or the final status (str) for the ``end`` entry."""
    f = {as_str(k): v for k, v in fields.items()}
    if is_end_entry(f):
        return as_str(f.get("status", b""))
    ev = json.loads(as_str(f["ev"]))
    return TokenEvent(
        job_id=job_id, sample=ev["s"], index=ev["i"], token_ids=ev["t"], text=ev["x"], finish_reason=ev.get("f"),
        logprobs=ev.get("l"), prompt_logprobs=ev.get("p"), prompt_tokens=ev.get("n"), prompt_token_ids=ev.get("pt"),
    )


class EventDeduper:
    """Drops events a subscriber has already seen, by token index per sample.

    A job re-run after a crash may publish an index range twice (a worker that
    was presumed dead and kept going); visible output stays exactly once.
    """

    def __init__(self, from_index: int = 0) -> None:
        self.from_index = from_index
        self.next_index: dict[int, int] = {}
        self.finished: set[int] = set()

    def accept(self, ev: TokenEvent) -> bool:
        nxt = self.next_index.get(ev.sample, self.from_index)
        if ev.sample in self.finished:
            return False
        if ev.token_ids:
            if ev.end_index <= nxt:
                return False
        elif ev.index < nxt and ev.finish_reason is None:
            return False
        self.next_index[ev.sample] = max(nxt, ev.end_index)
        if ev.finish_reason is not None:
            self.finished.add(ev.sample)
        return True
