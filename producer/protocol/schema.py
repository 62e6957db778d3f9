"""Wire schema of the queue path: what producers submit and what workers hand back.

Everything here is pydantic v2 and free of torch/engine imports, so a web
backend validates a job with the same rules the worker applies. Bad input
raises ``pydantic.ValidationError`` (a ``ValueError``) naming the field and
what is allowed. Sizes are bounded by ``producer.protocol.limits`` (settings from the
environment), and nothing that JSON cannot carry back unchanged (NaN, infinity,
lone surrogates, non-JSON metadata) is accepted, so a valid job survives the
trip through a lane stream exactly.
"""
from __future__ import annotations

import json
import time
import uuid
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_serializer, model_validator

from pagestream.producer.protocol.chat_template import BOTH_PROMPT_OPTIONS, check_chat_template, check_template_kwargs
from pagestream.producer.protocol.limits import job_limits
from pagestream.producer.protocol.structured import ResponseFormat, StructuredOutputs, from_response_format
from pagestream.producer.protocol.untrusted import UntrustedJSONError, check_json_tree

#: bump when a change to JobRequest/TokenEvent/JobResult is not backward compatible
SCHEMA_VERSION = 1

# Job ids become part of key names and a hash tag: no braces, no whitespace.
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$"
#: token ids are vocabulary indices: they must fit the int32 tensors the engine builds
MAX_TOKEN_ID = 2**31 - 1
MAX_MODEL_NAME_CHARS = 256
#: most alternatives a job may ask for per output token (OpenAI's ``top_logprobs`` limit, the engine's too)
MAX_LOGPROBS = 20
#: what a logprob of -inf (a token the model rules out) is written as: JSON has no infinity (OpenAI and vLLM use it too)
MIN_LOGPROB = -9999.0


class JobStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_final(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


class ErrorCode(str, Enum):
    """Why a failed job failed, where the cause is the request itself rather than the system."""

    # the engine refused the input (a prompt longer than the context, n above max_num_seqs, ...):
    # running it again cannot help, so the gateway answers 400 (as vLLM does), not 500
    INVALID_INPUT = "invalid_input"


class Lane(str, Enum):
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


def _check_utf8(value: str, what: str) -> str:
    # A str with lone surrogates (e.g. from bytes decoded with surrogateescape) cannot go
    # on the wire as UTF-8; say so here instead of failing inside redis-py.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8 text (position {exc.start}): {exc.reason}") from None
    return value


def _at_most(what: str, value: int, limit: int, field: str, unit: str = "") -> None:
    if value > limit:
        raise ValueError(f"{what} is {value}{unit}; at most {limit}{unit} allowed (PAGESTREAM_{field.upper()})")


def _utf8_bytes(value: str) -> int:
    return len(value) if value.isascii() else len(value.encode("utf-8"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # any role goes to the model's chat template, as vLLM passes it (the template decides what it means)
    role: str = Field(min_length=1, max_length=64)
    content: str
    # tools (issue 26): an assistant's calls (arguments as objects) and a tool message's answer id
    tool_calls: list[dict[str, JsonValue]] | None = None
    tool_call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)

    @field_validator("content")
    @classmethod
    def _utf8(cls, v: str) -> str:
        return _check_utf8(v, "message content")


class SamplingOptions(BaseModel):
    """Mirror of ``engine.SamplingParams`` with the same ranges, checked at submit time."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_TOKEN_ID)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    # defaults stay within the limits whatever PAGESTREAM_MAX_* says
    max_tokens: int | None = Field(default_factory=lambda: min(16, job_limits().max_tokens), ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # per output token: the sampled token's logprob and this many most likely alternatives (0: none)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # per prompt token after the first: its logprob and this many most likely alternatives (vLLM's
    # prompt_logprobs), in the result's ``prompt_logprobs``
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # constrain the output (JSON schema, JSON object, regex, choice, grammar); OpenAI's
    # response_format is taken too and travels as the structured_outputs it means
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = Field(None, exclude=True)
    # OpenAI's logit_bias (token id -> a value added to its logit, [-100, 100]); vLLM's allowed_token_ids
    logit_bias: dict[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)], Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _response_format(self) -> SamplingOptions:
        if self.response_format is not None:
            constraint = from_response_format(self.response_format)
            if constraint is not None and self.structured_outputs is not None:
                raise ValueError("give response_format or structured_outputs, not both")
            self.structured_outputs = self.structured_outputs or constraint
            self.response_format = None
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("logprobs", "prompt_logprobs", mode="before")
    @classmethod
    def _logprobs_count(cls, v: Any) -> Any:
        # OpenAI's chat habit (logprobs=True) would silently mean 1 alternative: say what the field is
        if isinstance(v, bool):
            raise ValueError(f"this is the number of alternatives per token (0-{MAX_LOGPROBS}), not true/false; "
                             "logprobs=0 returns the sampled token's logprob only")
        return v

    @field_validator("n")
    @classmethod
    def _n_limit(cls, v: int) -> int:
        _at_most("n", v, job_limits().max_n, "max_n")
        return v

    @field_validator("max_tokens", "min_tokens")
    @classmethod
    def _tokens_limit(cls, v: int | None, info) -> int | None:
        if v is not None:
            _at_most(info.field_name, v, job_limits().max_tokens, "max_tokens")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, v: list[str] | None) -> list[str] | None:
        limits = job_limits()
        _at_most("the number of stop strings", len(v or []), limits.max_stop_strings, "max_stop_strings")
        for s in v or []:
            _check_utf8(s, "stop string")
            _at_most(f"stop string {s[:20]!r}...", _utf8_bytes(s), limits.max_stop_string_bytes, "max_stop_string_bytes",
                     " bytes")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        _at_most("the number of stop_token_ids", len(v or []), job_limits().max_stop_token_ids, "max_stop_token_ids")
        if v and any(t < 0 or t > MAX_TOKEN_ID for t in v):
            raise ValueError(f"stop_token_ids must be in [0, {MAX_TOKEN_ID}]")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingOptions:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    @model_serializer(mode="wrap")
    def _keep_unbounded_max_tokens(self, handler: Any) -> dict[str, Any]:
        # max_tokens=None (generate up to the context) differs from the default 16: it must
        # survive the exclude_none dump that puts a job on the wire.
        data = handler(self)
        if self.max_tokens is None:
            data["max_tokens"] = None
        return data

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``engine.SamplingParams``."""
        return self.model_dump()


SAMPLING_FIELDS = frozenset(SamplingOptions.model_fields)


class OutputTarget(BaseModel):
    """Where a job's output goes: per-job Redis streams, or a bulk sink (S3 or a local dir)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["redis", "bulk"] = "redis"
    bulk_id: str | None = Field(None, max_length=128)
    custom_id: str | None = Field(None, max_length=512)
    uri: str | None = Field(None, max_length=4096)  # s3://bucket/prefix or a local directory

    @model_validator(mode="after")
    def _bulk_needs_id(self) -> OutputTarget:
        if self.kind == "bulk" and not self.bulk_id:
            raise ValueError("output.kind='bulk' needs output.bulk_id")
        return self


class JobRequest(BaseModel):
    """One prompt job as it travels through a lane stream.

    Exactly one of ``prompt``, ``messages`` (chat, the model's template is applied
    by the worker) or ``prompt_token_ids`` is given. Sampling fields may be passed
    flat (``JobRequest(prompt="hi", max_tokens=8)``) or as ``sampling=...``.
    ``ttl_s`` is turned into an absolute ``deadline`` (unix seconds) at creation;
    a job whose deadline passed before a worker starts it ends as ``expired``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    schema_version: int = SCHEMA_VERSION
    job_id: str = Field(default_factory=lambda: uuid.uuid4().hex, pattern=JOB_ID_PATTERN)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    model: str | None = Field(None, max_length=MAX_MODEL_NAME_CHARS)
    lane: Lane = Lane.NORMAL
    priority: int = 0  # inside a lane: lower runs first in the engine's waiting queue
    created_at: float = Field(default_factory=time.time)
    deadline: float | None = None
    ttl_s: float | None = Field(None, gt=0)
    result_ttl_s: int = Field(default_factory=lambda: min(24 * 3600, job_limits().max_result_ttl_s), ge=1)
    output: OutputTarget = Field(default_factory=OutputTarget)
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    # -- vLLM's request extensions (issue 24), carried to the worker --
    #: the result carries the prompt's token ids (vLLM's ``return_token_ids``; the worker tokenized the prompt)
    return_prompt_token_ids: bool = False
    #: the job's first token event carries its ``prompt_logprobs`` too, not only its result (a stream that echoes
    #: the prompt with its logprobs, as vLLM's streamed ``echo``, needs them with its first chunk)
    stream_prompt_logprobs: bool = False
    #: chat tools for the template (OpenAI's ``{"type": "function", "function": {...}}`` objects, issue 26)
    tools: list[dict[str, JsonValue]] | None = None
    #: vLLM's chat-template options (``producer.protocol.chat_template``); None: the default (a generation
    #: prompt, no continued final message, the model's own template, no extra template variables)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, JsonValue] | None = None
    #: vLLM's ``truncate_prompt_tokens``: the worker keeps this many of the prompt's tokens right after tokenizing it
    #: (a chat's after its template), the last ones (``truncation_side`` "left", the default) or the first ("right");
    #: -1: the model's context length (``max_model_len``); more than that is refused (by the gateway and the engine)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_TOKEN_ID)
    truncation_side: Literal["left", "right"] | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_not_zero(cls, v: int | None) -> int | None:
        if v == 0:  # vLLM's renderer makes no prompt of it; here that is the empty prompt's 400, said plainly
            raise ValueError("truncate_prompt_tokens must be at least 1 (or -1: the model's context length); "
                             "0 would leave an empty prompt")
        return v

    def truncated_prompt_ids(self, ids: list[int], max_model_len: int | None = None) -> list[int]:
        """``ids`` cut as ``truncate_prompt_tokens`` / ``truncation_side`` say (-1: to ``max_model_len``, when known)."""
        return truncate_ids(ids, self.truncate_prompt_tokens, self.truncation_side, max_model_len)

    @field_validator("chat_template")
    @classmethod
    def _template_limits(cls, v: str | None) -> str | None:
        return v if v is None else check_chat_template(v)

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs_limits(cls, v: Any) -> Any:
        # before pydantic walks it: a deep tree is refused without recursing into it
        return v if v is None else check_template_kwargs(v)

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_limits(cls, v: Any) -> Any:
        if isinstance(v, list):
            from pagestream.producer.protocol.structured import MAX_SCHEMA_DEPTH

            try:
                check_json_tree(v, MAX_SCHEMA_DEPTH + 3)  # the list, a tool, its function, then the schema
            except UntrustedJSONError as exc:
                raise ValueError(f"tools: {exc}") from None
            try:
                size = len(json.dumps(v, ensure_ascii=False).encode("utf-8"))
            except (TypeError, ValueError):
                return v
            _at_most("tools as JSON", size, job_limits().max_prompt_bytes, "max_prompt_bytes", " bytes")
        return v

    @model_validator(mode="before")
    @classmethod
    def _hoist_flat_sampling(cls, data: Any) -> Any:
        if isinstance(data, dict):
            flat = {k: data[k] for k in data if k in SAMPLING_FIELDS}
            nested = data.get("sampling") or {}
            if isinstance(nested, BaseModel):
                nested = nested.model_dump(exclude_unset=True)
            if flat and isinstance(nested, dict):  # anything else: the field check says what is wrong
                data = {k: v for k, v in data.items() if k not in SAMPLING_FIELDS}
                data["sampling"] = {**nested, **flat}
        return data

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v > SCHEMA_VERSION or v < 1:
            raise ValueError(f"schema_version {v} is not supported (this build speaks 1..{SCHEMA_VERSION})")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt_utf8(cls, v: str | None) -> str | None:
        if v is not None:
            _check_utf8(v, "prompt")
            _at_most("prompt", _utf8_bytes(v), job_limits().max_prompt_bytes, "max_prompt_bytes", " bytes")
        return v

    @field_validator("messages")
    @classmethod
    def _messages_limits(cls, v: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if v is not None:
            limits = job_limits()
            _at_most("the number of messages", len(v), limits.max_messages, "max_messages")
            total = sum(_utf8_bytes(m.content) for m in v)
            _at_most("all message contents together", total, limits.max_prompt_bytes, "max_prompt_bytes", " bytes")
        return v

    @field_validator("prompt_token_ids")
    @classmethod
    def _ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            _at_most("the number of prompt_token_ids", len(v), job_limits().max_prompt_token_ids, "max_prompt_token_ids")
            if v and (min(v) < 0 or max(v) > MAX_TOKEN_ID):  # in C: this runs for every id of every job, twice
                raise ValueError(f"prompt_token_ids must be in [0, {MAX_TOKEN_ID}]")
        return v

    @field_validator("result_ttl_s")
    @classmethod
    def _ttl_limit(cls, v: int) -> int:
        _at_most("result_ttl_s", v, job_limits().max_result_ttl_s, "max_result_ttl_s", " s")
        return v

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_limits(cls, v: Any) -> Any:
        # Before pydantic walks it: a deep tree must be refused without recursing into it.
        if isinstance(v, dict):
            limits = job_limits()
            try:
                check_json_tree(v, limits.max_metadata_depth)
            except UntrustedJSONError as exc:
                raise ValueError(f"{exc}; metadata takes UTF-8 text nested at most {limits.max_metadata_depth} levels "
                                 "(PAGESTREAM_MAX_METADATA_DEPTH)") from None
            try:
                size = len(json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
            except (TypeError, ValueError):
                return v  # not JSON: the JsonValue type says what is wrong
            _at_most("metadata as JSON", size, limits.max_metadata_bytes, "max_metadata_bytes", " bytes")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, messages, prompt_token_ids (got {given or 'none'})")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need messages (a chat job)")
        options = [name for name in ("add_generation_prompt", "continue_final_message", "chat_template",
                                     "chat_template_kwargs") if getattr(self, name) is not None]
        if options and self.messages is None:
            raise ValueError(f"{', '.join(options)} need messages (a chat job)")
        if self.continue_final_message and self.add_generation_prompt is not False:
            raise ValueError(BOTH_PROMPT_OPTIONS + " (add_generation_prompt defaults to true: set it to false)")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if self.ttl_s is not None and self.deadline is None:
            self.deadline = self.created_at + self.ttl_s
        return self

    def is_expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (now if now is not None else time.time()) > self.deadline


def truncate_ids(ids: list[int], k: int | None, side: str | None, max_model_len: int | None = None) -> list[int]:
    """vLLM's truncation of a tokenized prompt: its last ``k`` tokens (``side`` "right": its first ``k``); ``k`` -1 is
    ``max_model_len`` (left as is while that is unknown); None: all of them."""
    if k is not None and k < 0:
        k = max_model_len
    if k is None or len(ids) <= k:
        return ids
    return ids[:k] if side == "right" else ids[len(ids) - k:]


def _compact_or_fields(data: Any, names: tuple[str, ...]) -> Any:
    # The wire form is a JSON array in field order (see TokenLogprob); a dict passes as is.
    if isinstance(data, (list, tuple)):
        if len(data) != len(names):
            raise ValueError(f"expected [{', '.join(names)}], got {len(data)} items")
        return dict(zip(names, data))
    return data


class TopLogprob(BaseModel):
    """One of the most likely tokens at a position; on the wire ``[token_id, token, logprob]``."""

    model_config = ConfigDict(allow_inf_nan=False)

    token_id: int
    token: str  # the token decoded on its own (may hold U+FFFD for part of a multi-byte character)
    logprob: float

    @model_validator(mode="before")
    @classmethod
    def _from_wire(cls, data: Any) -> Any:
        return _compact_or_fields(data, ("token_id", "token", "logprob"))

    @model_serializer(mode="plain")
    def _to_wire(self) -> list:
        return [self.token_id, self.token, self.logprob]


class TokenLogprob(BaseModel):
    """Log probability of one sampled output token, and the job's ``logprobs`` most likely
    tokens at its position (most likely first; the sampled one may or may not be among them).

    Stored and sent compactly as ``[token_id, token, logprob, [[token_id, token, logprob], ...]]``
    (a result with thousands of tokens times 20 alternatives stays a few hundred KB, not MBs);
    in Python it is this typed model.
    """

    model_config = ConfigDict(allow_inf_nan=False)

    token_id: int
    token: str
    logprob: float | None  # None only for a prompt's first token, which nothing scores (``prompt_logprobs``)
    top_logprobs: list[TopLogprob] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _from_wire(cls, data: Any) -> Any:
        return _compact_or_fields(data, ("token_id", "token", "logprob", "top_logprobs"))

    @model_serializer(mode="plain")
    def _to_wire(self) -> list:
        return [self.token_id, self.token, self.logprob, [t._to_wire() for t in self.top_logprobs]]


class TokenEvent(BaseModel):
    """A delta of one sample: ``token_ids`` start at output index ``index``.

    Concatenating ``text`` of all events of a sample (in index order, each index
    once) gives the final text. ``text`` can lag the tokens (partial UTF-8 or stop
    strings are held back) and the last event may carry text but no tokens.
    ``logprobs`` (when the job asked for them) has one entry per token of ``token_ids``.
    ``prompt_logprobs`` (a job with ``stream_prompt_logprobs``) come on the job's first event, one per prompt token;
    so do ``prompt_tokens`` (the prompt's size, every job) and ``prompt_token_ids`` (``return_prompt_token_ids``).
    """

    job_id: str
    sample: int = 0
    index: int
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None

    @property
    def end_index(self) -> int:
        return self.index + len(self.token_ids)


class SampleResult(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the job asked for them


class JobResult(BaseModel):
    """Final outcome of a job. For n > 1 the fields at top level are sample 0's."""

    schema_version: int = SCHEMA_VERSION
    job_id: str
    status: JobStatus
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_code: ErrorCode | None = None
    outputs: list[SampleResult] = Field(default_factory=list)
    prompt_tokens: int = 0
    # prompt tokens this delivery's run found in the worker's prefix cache (vLLM's RequestOutput.num_cached_tokens)
    num_cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_token_ids: list[int] | None = None  # when the job asked (``return_prompt_token_ids``)
    # when the job asked (``sampling.prompt_logprobs``): one per prompt token, the first with logprob None
    prompt_logprobs: list[TokenLogprob] | None = None
    worker: str | None = None
    model: str | None = None  # the model the worker served (routing by model), not the name asked for
    deliveries: int = 0
    resumed_from: int = 0  # output tokens taken over from an earlier delivery
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float = Field(default_factory=time.time)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == JobStatus.COMPLETED

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """Sample 0's logprobs (``outputs[i].logprobs`` per sample). Not a second copy like ``text``:
        with 20 alternatives they are ~0.7 KB per token, the bulk of a result."""
        return self.outputs[0].logprobs if self.outputs else None


class DeadLetter(BaseModel):
    """What the dead-letter stream keeps about a job (the raw payload rides beside it)."""

    lane: str
    entry_id: str
    job_id: str | None = None
    reason: str
    deliveries: int = 1
    worker: str | None = None
    at: float = Field(default_factory=time.time)


def format_validation_error(exc: Any, *, prefix: str = "", max_errors: int | None = None) -> str:
    """A pydantic ValidationError on one line: ``field: what is wrong; ...`` (fields under ``prefix``)."""
    parts = []
    errors = exc.errors()
    for err in errors[:max_errors]:
        loc = ".".join([prefix] * bool(prefix) + [str(x) for x in err.get("loc", ()) if x != "__root__"]) or "job"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    if max_errors is not None and len(errors) > max_errors:
        parts.append(f"and {len(errors) - max_errors} more error(s)")
    return "; ".join(parts)
