"""What a lane entry becomes inside a worker: parsing, salvage of broken entries, resume history."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import redis
from pydantic import ValidationError

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.job import WORKER_CLAIM_LUA
from pagestream.producer.protocol.redis_conn import queue_script
from pagestream.producer.protocol.schema import JOB_ID_PATTERN, JobRequest, OutputTarget, format_validation_error
from pagestream.producer.protocol.wire import JOB_FIELD, EventDeduper, UntrustedJSONError, decode_out_entry, loads_untrusted
from pagestream.worker.consumer import Delivery, entry_size

_JOB_ID_RE = re.compile(JOB_ID_PATTERN)
# A job id written the way JobRequest serializes it; ends at its closing quote, so a longer or
# escaped value never matches. Used only on payloads that do not parse.
_RAW_JOB_ID_RE = re.compile(rb'"job_id"\s*:\s*"(' + JOB_ID_PATTERN.strip("^$").encode() + rb')"')
#: how far into a broken payload ``salvage`` looks for a job id (the producer writes it second)
SALVAGE_SCAN_BYTES = 64 * 1024
DEFAULT_RESULT_TTL_S = 24 * 3600


@dataclass
class SampleOutput:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[list] = field(default_factory=list)  # TokenLogprob wire form, one per token id (if asked for)


@dataclass
class ActiveJob:
    delivery: Delivery
    job: JobRequest
    params: Any = None  # engine SamplingParams
    resume: list[int] | None = None
    samples: dict[int, SampleOutput] = field(default_factory=dict)
    started_at: float = 0.0
    prompt_tokens: int = 0
    num_cached_tokens: int = 0  # the engine's (prefix-cache hit of this delivery's run), with its final output
    prompt_token_ids: list[int] | None = None  # kept only for a job with return_prompt_token_ids
    prompt_logprobs: list[list] | None = None  # TokenLogprob wire form, one per prompt token (if asked for)
    prompt_logprobs_streamed: bool = False  # on a token event already (a job with stream_prompt_logprobs)
    first_delta_sent: bool = False  # the prompt's size (and ids, if asked) went with it
    has_job_hash: bool = False  # the submit left a job hash (bulk jobs from the orchestrator have one)
    tokens_published: bool = False  # an earlier delivery published tokens (load_history): no first_token event now
    # copied out of the job: read for every delta of every step
    job_id: str = field(init=False)
    is_bulk: bool = field(init=False)

    def __post_init__(self) -> None:
        self.job_id = self.job.job_id
        self.is_bulk = self.job.output.kind == "bulk"


class InvalidJob(Exception):
    """A job that can never run (bad payload, bad params, prompt too long...)."""


def parse_delivery(d: Delivery, max_entry_bytes: int) -> JobRequest:
    """The JobRequest in a lane entry; ``InvalidJob`` saying what is wrong otherwise.

    The size is checked before anything is parsed (a raw XADD bypasses the producer's
    limits), then the payload goes through ``loads_untrusted`` (depth, lone surrogates,
    NaN) before pydantic, so nothing that reaches a result can fail to serialize later.
    """
    size = entry_size(d.fields)
    if size > max_entry_bytes:
        raise InvalidJob(f"entry is {size} bytes; at most {max_entry_bytes} are accepted (worker max_entry_bytes)")
    raw = d.fields.get(JOB_FIELD.encode()) if d.fields else None
    if raw is None:
        raise InvalidJob(f"entry has no {JOB_FIELD!r} field (fields: {sorted(k.decode('utf-8', 'replace')[:64] for k in d.fields or {})[:8]})")
    try:
        data = loads_untrusted(raw, max_bytes=max_entry_bytes)
    except UntrustedJSONError as exc:
        raise InvalidJob(f"invalid job payload: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidJob(f"job payload must be a JSON object, got {type(data).__name__}")
    try:
        job = JobRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidJob("invalid job: " + format_validation_error(exc)) from None
    lane, _ = keys.split_lane_key(d.lane)  # a shard of the lane on a cluster: normal/3
    if job.lane.value != lane:
        raise InvalidJob(f"job says lane {job.lane.value!r} but was queued on lane {lane!r}")
    return job


def load_history(client: redis.Redis, jobs: list[ActiveJob]) -> None:
    """Tokens an earlier delivery already published: the job continues after them."""
    pipe = client.pipeline(transaction=False)
    for a in jobs:
        pipe.xrange(keys.out_stream(a.job_id))
    for a, entries in zip(jobs, pipe.execute()):
        dedup = EventDeduper()
        for _, fields in entries:
            ev = decode_out_entry(a.job_id, fields)
            if isinstance(ev, str) or not dedup.accept(ev):
                continue
            s = a.samples.setdefault(ev.sample, SampleOutput())
            s.token_ids.extend(ev.token_ids)
            s.text.append(ev.text)
            if ev.logprobs is not None:  # as published: the re-run reports logprobs only for tokens after these
                s.logprobs.extend(lp.model_dump() for lp in ev.logprobs)
        a.tokens_published = any(s.token_ids for s in a.samples.values())
        if a.job.sampling.n == 1 and a.samples.get(0) and a.samples[0].token_ids:
            a.resume = list(a.samples[0].token_ids)
        else:
            # n > 1: the engine resumes one sample only; start over, subscribers drop
            # the indices they already saw (exact when seeded)
            a.samples.clear()


def claim_entries(client: redis.RedisCluster, jobs: list[ActiveJob]) -> list[tuple[bytes | None, bytes | None, bool]]:
    """(status, cancel_requested, this entry is the job's own) per job, in one pipelined round trip (cluster only):
    the first entry named in the job hash wins, by the producer's settle step or here (producer.protocol.job)."""
    pipe = client.pipeline(transaction=False)
    for a in jobs:
        queue_script(pipe, "EVAL", WORKER_CLAIM_LUA, [keys.job_hash(a.job_id)], [a.delivery.entry_id, a.delivery.lane])
    return [(st or None, cr or None, bool(int(won))) for st, cr, won in pipe.execute()]


class NoAckPipe:
    """Lets ``Consumer.dead_letter`` copy to the DLQ without acking (bulk entries are acked by the sink)."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client

    def xadd(self, *a: Any, **kw: Any) -> Any:
        return self._client.xadd(*a, **kw)

    def xack(self, *a: Any, **kw: Any) -> None:
        return None


def salvage(d: Delivery, job: JobRequest | None, max_entry_bytes: int) -> tuple[str | None, OutputTarget | None, int, dict]:
    """Job id, output target, result TTL and metadata from a job, or best effort from a broken payload.

    A payload that does not parse (too big, too deep, a lone surrogate, cut short) still
    names its job when ``"job_id": "<a valid id>"`` appears exactly once near its start, so
    the producer waiting on that job gets a failed result instead of silence.
    """
    if job is not None:
        return job.job_id, job.output, job.result_ttl_s, job.metadata
    raw = (d.fields or {}).get(JOB_FIELD.encode(), b"")
    try:
        data = loads_untrusted(raw, max_bytes=max_entry_bytes)
    except UntrustedJSONError:
        ids = {m.group(1).decode() for m in _RAW_JOB_ID_RE.finditer(raw[:SALVAGE_SCAN_BYTES])}
        return (ids.pop() if len(ids) == 1 else None), None, DEFAULT_RESULT_TTL_S, {}
    if not isinstance(data, dict):
        return None, None, DEFAULT_RESULT_TTL_S, {}
    job_id = data.get("job_id")
    if not isinstance(job_id, str) or not _JOB_ID_RE.fullmatch(job_id):
        job_id = None
    try:
        output = OutputTarget.model_validate(data.get("output") or {})
    except ValueError:
        output = None
    ttl = data.get("result_ttl_s")
    ttl = ttl if isinstance(ttl, int) and ttl > 0 else DEFAULT_RESULT_TTL_S
    meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    return job_id, output, ttl, meta
