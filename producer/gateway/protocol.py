"""OpenAI's request and response shapes, and how they map onto jobs (no I/O here).

Requests are pydantic models that take OpenAI's fields; ``to_job`` turns one into
a ``JobRequest`` (the job schema then checks ranges with the same rules every
producer gets). Responses are plain dicts in OpenAI's layout: completion,
chat.completion, their stream chunks, and the error object.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagestream.producer.protocol.schema import JobRequest, JobResult, SampleResult, TokenLogprob


class GatewayError(Exception):
    """An error the client sees in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    # Unknown OpenAI fields (user, metadata, service_tier...) are accepted and ignored, as vLLM does.
    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions that the engine has
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None

    def sampling(self) -> dict[str, Any]:
        fields = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "top_k", "min_p",
                  "repetition_penalty", "min_tokens", "ignore_eos")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    # a count; ``true`` is kept as sent so the job schema refuses it with a 400 that says so, not read as 1
    logprobs: bool | int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompt_fields(self) -> dict[str, Any]:
        if self.echo:
            raise GatewayError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise GatewayError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise GatewayError(400, "best_of other than n is not supported", param="best_of")
        p = self.prompt
        if isinstance(p, str):
            return {"prompt": p}
        if p and all(isinstance(x, int) for x in p):
            return {"prompt_token_ids": p}
        if len(p) == 1:
            return {"prompt": p[0]}
        raise GatewayError(400, "prompt must be one string or one list of token ids (send one request per prompt)", param="prompt")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def flat(self) -> dict[str, str]:
        if isinstance(self.content, list):
            bad = [p.type for p in self.content if p.type != "text" or p.text is None]
            if bad:
                raise GatewayError(400, f"only text content parts are supported, got {bad}", param="messages")
            text = "".join(p.text or "" for p in self.content)
        else:
            text = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = None  # None: until the model stops or the context is full
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def chat_logprobs_k(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """The job's ``logprobs`` for chat's pair of fields: ``logprobs: true`` asks for them,
    ``top_logprobs`` (default 0) says how many alternatives (the job schema checks the range)."""
    if top_logprobs is not None and not logprobs:
        raise GatewayError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def to_job(req: CompletionRequest | ChatCompletionRequest, job_id: str) -> JobRequest:
    """The job this request becomes (raises ``pydantic.ValidationError`` for out-of-range values)."""
    fields: dict[str, Any] = {"job_id": job_id, "model": req.model, **req.sampling()}
    if isinstance(req, ChatCompletionRequest):
        fields["messages"] = [m.flat() for m in req.messages]
        fields["max_tokens"] = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        k = chat_logprobs_k(req.logprobs, req.top_logprobs)
    else:
        fields.update(req.prompt_fields())
        fields["max_tokens"] = req.max_tokens
        k = req.logprobs
    if k is not None:
        fields["logprobs"] = k
    return JobRequest.model_validate(fields)


def request_param(loc: str | None, chat: bool) -> str | None:
    """The request field a job-schema error is about: ``sampling.logprobs`` is chat's ``top_logprobs``."""
    if loc is None:
        return None
    loc = loc.removeprefix("sampling.")
    return "top_logprobs" if chat and loc == "logprobs" else loc


# ---- responses ---------------------------------------------------------------------------------

def finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


def usage(result: JobResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(lps: list[TokenLogprob]) -> dict:
    """``choices[].logprobs`` of chat: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``."""
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token),
                         "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": _bytes(a.token)} for a in t.top_logprobs]}
                        for t in lps],
            "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], text_offset: int = 0) -> dict:
    """``choices[].logprobs`` of /v1/completions; ``text_offset`` of the first token (a stream continues it).

    Offsets add up the tokens' own texts, so a character split over two tokens counts
    each part's replacement character (as other servers that decode tokens alone do).
    """
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in lps:
        out["tokens"].append(t.token)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({a.token: a.logprob for a in t.top_logprobs})
        out["text_offset"].append(text_offset)
        text_offset += len(t.token)
    return out


def choice_logprobs(chat: bool, lps: list[TokenLogprob] | None, text_offset: int = 0) -> dict | None:
    if lps is None:
        return None
    return chat_logprobs(lps) if chat else completion_logprobs(lps, text_offset)


def completion_body(chat: bool, rid: str, model: str, created: int, result: JobResult) -> dict:
    # a result built by hand may carry only the top-level fields (sample 0)
    samples = result.outputs or [SampleResult(index=0, text=result.text, token_ids=result.token_ids, finish_reason=result.finish_reason)]
    choices = []
    for s in samples:
        choice: dict[str, Any] = {"index": s.index, "logprobs": choice_logprobs(chat, s.logprobs),
                                  "finish_reason": finish_reason(s.finish_reason)}
        if chat:
            choice["message"] = {"role": "assistant", "content": s.text}
        else:
            choice["text"] = s.text
        choices.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(result)}


def chunk(chat: bool, rid: str, model: str, created: int, index: int, text: str | None,
          reason: str | None = None, role: bool = False, logprobs: dict | None = None) -> dict:
    """One stream chunk; ``logprobs`` is ``choice_logprobs`` of the chunk's tokens."""
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}


def usage_chunk(chat: bool, rid: str, model: str, created: int, result: JobResult) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(result)}


def model_list(models: list[str]) -> dict:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": int(time.time()), "owned_by": "pagestream"} for m in models]}
