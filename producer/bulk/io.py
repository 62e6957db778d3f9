"""Bulk input lines in, OpenAI batch output lines out.

Input, one JSON object per line, in either form:

- OpenAI Batch: ``{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body": {...}}``
- plain: ``{"custom_id"?, "prompt" | "messages", <sampling fields>}`` (custom_id defaults to ``line-<n>``)

``parse_line`` never raises on user input: a bad line comes back as ``BadLine``
with its 1-based line number and a reason that says what was wrong. Lines are
parsed with ``loads_untrusted`` (size, nesting depth, lone surrogates, NaN), so a
nesting bomb or a line of hundreds of MiB is one error line, not a stalled bulk.
"""
from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagestream.producer.protocol.chat_template import template_options
from pagestream.producer.protocol.errors import RequestError
from pagestream.producer.protocol.openai import (
    CHAT_URL,
    COMPLETIONS_URL,
    ChatMessageIn,
    chat_logprobs_k,
)
from pagestream.producer.protocol.limits import job_limits
from pagestream.producer.protocol.schema import MAX_LOGPROBS, format_validation_error
from pagestream.producer.protocol.structured import removed_guided
from pagestream.producer.protocol.tools import MAX_TOOLS, ChatTool, ToolChoice, ToolUse
from pagestream.producer.protocol.untrusted import UntrustedJSONError, loads_untrusted

SUPPORTED_URLS = (COMPLETIONS_URL, CHAT_URL)
MAX_CUSTOM_ID_CHARS = 512
#: OpenAI's default ``max_tokens`` for /v1/completions (chat has none: until the model stops)
OPENAI_COMPLETIONS_MAX_TOKENS = 16
_quote = reprlib.Repr()  # a reason quotes user input, never all of it
_quote.maxstring = _quote.maxother = 60
_short = _quote.repr


class RequestBody(BaseModel):
    """The fields of a completions / chat body we act on; unknown fields are ignored like OpenAI's batch does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessageIn] | None = None  # content: a string or text parts, as the gateway takes it
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    n: int | None = Field(default=None, ge=1)  # one choice per sample; the job schema holds the upper limit
    # chat: ``logprobs: true`` + ``top_logprobs: k``; completions: ``logprobs: k`` (``logprobs_k`` reads them per url)
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    # vLLM's prompt_logprobs (both endpoints): the output body carries them in vLLM's shape; the job schema checks the range
    prompt_logprobs: int | None = None
    # structured outputs (issue 23): OpenAI's response_format, vLLM's structured_outputs; the job schema checks them
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # OpenAI's logit_bias and vLLM's allowed_token_ids; the job schema checks them
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    # tools (issue 26) as the gateway's chat request takes them (producer.protocol.tools): the job renders them
    # and holds required / named to their schemas; the output line's calls are read as the gateway reads them.
    # A /v1/completions line ignores them, as the gateway's /v1/completions does.
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template options (producer.protocol.chat_template; the job schema checks the kwargs); a template
    # sent with the line is refused: nothing in a bulk says whether its submitter is trusted with one
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template")
    @classmethod
    def _no_request_template(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("chat_template in batch lines is not supported (the gateway's /v1/chat/completions "
                             "takes it when started with --trust-request-chat-template)")
        return v

    @field_validator("messages")
    @classmethod
    def _text_parts_only(cls, v: list[ChatMessageIn] | None) -> list[ChatMessageIn] | None:
        for m in v or []:
            try:
                m.flat()
            except RequestError as exc:
                raise ValueError(exc.message) from None
        return v

    def tool_use(self) -> ToolUse:
        """The line's tools and ``tool_choice`` resolved as the gateway resolves a chat request's (``RequestError``)."""
        return ToolUse.resolve(self.tools, self.tool_choice, self.parallel_tool_calls)

    def logprobs_k(self, url: str) -> int | None:
        """The job's ``logprobs`` (alternatives per token) as OpenAI's endpoint ``url`` spells it;
        ``ValueError`` saying what is wrong (the job schema checks the range)."""
        if url == CHAT_URL:
            if self.logprobs is not None and not isinstance(self.logprobs, bool):
                raise ValueError("for chat, logprobs is true or false; the number of alternatives is top_logprobs")
            try:
                return chat_logprobs_k(self.logprobs, self.top_logprobs)
            except RequestError as exc:
                raise ValueError(exc.message) from None
        if self.top_logprobs is not None:
            raise ValueError(f"top_logprobs is a chat field; {COMPLETIONS_URL} takes logprobs: <number of alternatives>")
        if isinstance(self.logprobs, bool):
            raise ValueError(f"for {COMPLETIONS_URL}, logprobs is the number of alternatives per token (0-{MAX_LOGPROBS}), not true/false")
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("prompt must be a string (or a list of exactly one string)")
            return v[0]
        return v

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' or 'messages' is required")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        if self.messages is None and self.template_options():
            raise ValueError("add_generation_prompt, continue_final_message and chat_template_kwargs are chat fields "
                             "(they need 'messages')")
        return self

    def template_options(self) -> dict[str, Any]:
        """The job fields of the line's chat-template options (those not at their default)."""
        return template_options(self.add_generation_prompt, self.continue_final_message, None, self.chat_template_kwargs)

    def sampling(self) -> dict[str, Any]:
        """Sampling fields the line set, as the job schema names them (``max_tokens`` only if given)."""
        out = {
            "n": self.n,
            "max_tokens": self.max_completion_tokens or self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "prompt_logprobs": self.prompt_logprobs,
            "response_format": self.response_format,
            "structured_outputs": self.structured_outputs,
            "logit_bias": self.logit_bias,
            "allowed_token_ids": self.allowed_token_ids,
        }
        return {k: v for k, v in out.items() if v is not None}


@dataclass(slots=True)
class BulkRequest:
    """One valid input line."""

    line: int
    custom_id: str
    url: str  # COMPLETIONS_URL or CHAT_URL
    body: RequestBody
    openai_form: bool = True  # False: a plain ``{"prompt" | "messages", ...}`` line
    logprobs: int | None = None  # alternatives per token the line asked for (None: no logprobs)

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL

    def max_tokens(self) -> int | None:
        """The line's token limit with OpenAI's defaults: 16 for an OpenAI ``/v1/completions`` line,
        otherwise none (generate until the model stops or the context is full)."""
        given = self.body.max_completion_tokens or self.body.max_tokens
        if given is None and self.openai_form and self.url == COMPLETIONS_URL:
            return OPENAI_COMPLETIONS_MAX_TOKENS
        return given

    def messages(self) -> list[dict[str, str]] | None:
        """Chat messages as the job schema takes them (text parts joined, ``developer`` as ``system``)."""
        return None if self.body.messages is None else [m.flat() for m in self.body.messages]


@dataclass(slots=True)
class BadLine:
    line: int
    reason: str
    custom_id: str | None = None
    code: str = "invalid_request"


def max_line_bytes() -> int:
    """The longest input line that can hold a job the limits accept (``JobLimits.max_entry_bytes``)."""
    return job_limits().max_entry_bytes


def _readable_custom_id(raw: str) -> str | None:
    """The top-level ``custom_id`` of a line the bounded reader refused (nested too deep, say), when the
    standard parser can still read it within its own recursion bound: the error line then names it."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return custom_id if isinstance(custom_id, str) and 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS else None


def parse_line(raw: bytes | str, line: int, max_bytes: int | None = None) -> BulkRequest | BadLine | None:
    """Parse one input line; ``None`` for a blank line (skipped, not an error).

    A line over ``max_bytes`` (default ``max_line_bytes()``) is refused unparsed; a
    reader may hand over just its first ``max_bytes + 1`` bytes (``split_lines``).
    """
    limit = max_line_bytes() if max_bytes is None else max_bytes
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    if size > limit:
        return BadLine(line, f"line is longer than {limit} bytes, more than any job within the limits needs "
                             "(PAGESTREAM_MAX_PROMPT_BYTES and the other PAGESTREAM_MAX_* settings)")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return BadLine(line, f"not UTF-8: {exc.reason} at byte {exc.start}")
    if not raw.strip():
        return None
    try:
        obj = loads_untrusted(raw, max_bytes=limit)
    except UntrustedJSONError as exc:
        return BadLine(line, f"invalid JSON: {str(exc).removeprefix('not valid JSON: ')}", _readable_custom_id(raw))
    if not isinstance(obj, dict):
        return BadLine(line, f"a line must be a JSON object, got {type(obj).__name__}")

    custom_id = obj.get("custom_id")
    if custom_id is not None and (not isinstance(custom_id, str) or not custom_id):
        return BadLine(line, "custom_id must be a non-empty string")
    if custom_id is not None and len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return BadLine(line, f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters")

    if "body" in obj or "url" in obj or "method" in obj:
        if custom_id is None:
            return BadLine(line, "custom_id is required in the OpenAI batch form")
        method = obj.get("method", "POST")
        if method != "POST":
            return BadLine(line, f"method must be POST, got {_short(method)}", custom_id)
        url = obj.get("url")
        if url not in SUPPORTED_URLS:
            return BadLine(line, f"url must be one of {', '.join(SUPPORTED_URLS)}, got {_short(url)}", custom_id)
        body = obj.get("body")
        if not isinstance(body, dict):
            return BadLine(line, "body must be a JSON object", custom_id)
        if (removed := removed_guided(body.get)) is not None:
            return BadLine(line, f"body.{removed[1]}", custom_id)
        try:
            parsed = RequestBody.model_validate(body)
        except ValidationError as exc:
            return BadLine(line, format_validation_error(exc, prefix="body", max_errors=3), custom_id)
        if url == COMPLETIONS_URL and parsed.prompt is None:
            return BadLine(line, f"{COMPLETIONS_URL} needs body.prompt", custom_id)
        if url == CHAT_URL and parsed.messages is None:
            return BadLine(line, f"{CHAT_URL} needs body.messages", custom_id)
        try:
            k = parsed.logprobs_k(url)
        except ValueError as exc:
            return BadLine(line, f"body: {exc}", custom_id)
        return BulkRequest(line=line, custom_id=custom_id, url=url, body=parsed, logprobs=k)

    fields = {k: v for k, v in obj.items() if k != "custom_id"}
    if (removed := removed_guided(fields.get)) is not None:
        return BadLine(line, removed[1], custom_id)
    try:
        parsed = RequestBody.model_validate(fields)
    except ValidationError as exc:
        return BadLine(line, format_validation_error(exc, prefix="line", max_errors=3), custom_id)
    url = CHAT_URL if parsed.messages is not None else COMPLETIONS_URL
    try:
        k = parsed.logprobs_k(url)
    except ValueError as exc:
        return BadLine(line, f"line: {exc}", custom_id)
    return BulkRequest(line=line, custom_id=custom_id or f"line-{line}", url=url, body=parsed, openai_form=False, logprobs=k)
