"""The gateway's request and response models: OpenAI's fields in, OpenAI's objects out (no I/O here).

Requests are pydantic models that take OpenAI's fields; ``to_job`` turns one into a
``JobRequest`` (the job schema then checks ranges with the same rules every producer gets).
Responses are plain dicts in OpenAI's layout; the bodies a bulk writes too live in the
contract (``producer.protocol.openai``).
"""
from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagestream.producer.protocol.errors import RequestError
from pagestream.producer.protocol.openai import ChatMessageIn, chat_logprobs_k, finish_reason, usage
from pagestream.producer.protocol.schema import JobRequest, JobResult

_SAMPLING = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "top_k", "min_p",
             "repetition_penalty", "min_tokens", "ignore_eos")


class StreamOptions(BaseModel):
    include_usage: bool = False


class OpenAIRequest(BaseModel):
    """Fields chat and completions share. Unknown OpenAI fields (user, metadata, service_tier...) are
    accepted and ignored, as vLLM does."""

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

    # ---- structured outputs (issue 23; owned by the structured-outputs work, kept apart) ----
    # OpenAI's response_format (text / json_object / json_schema) and vLLM's structured_outputs
    # extra field, both checked by the job schema (bad schema or regex: 400 naming it); vLLM's
    # removed guided_* fields are declared so they answer 400 naming their replacement, never ignored
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_json_object: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None

    def structured_fields(self) -> dict[str, Any]:
        from pagestream.producer.protocol.structured import GUIDED_REPLACEMENTS

        for name, replacement in GUIDED_REPLACEMENTS.items():
            if getattr(self, name, None) is not None:
                raise RequestError(f"{name} was removed (as in vLLM); use {replacement}", param=name)
        fields: dict[str, Any] = {}
        if self.response_format is not None:
            fields["response_format"] = self.response_format
        if self.structured_outputs is not None:
            fields["structured_outputs"] = self.structured_outputs
        return fields
    # ---- end of structured outputs ----

    def sampling(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in _SAMPLING if getattr(self, f) is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def job_fields(self) -> dict[str, Any]:
        """The request's own fields as JobRequest keyword fields (prompt or messages, max_tokens, logprobs)."""
        raise NotImplementedError

    def to_job(self, job_id: str) -> JobRequest:
        """The job this request becomes (raises ``pydantic.ValidationError`` for out-of-range values)."""
        return JobRequest.model_validate({"job_id": job_id, "model": self.model, **self.sampling(),
                                          **self.structured_fields(), **self.job_fields()})

    @staticmethod
    def param_of(loc: str | None) -> str | None:
        """The request field a job-schema error location (``sampling.top_p``) is about."""
        return None if loc is None else loc.removeprefix("sampling.")


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    # a count; ``true`` is kept as sent so the job schema refuses it with a 400 that says so, not read as 1
    logprobs: bool | int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def job_fields(self) -> dict[str, Any]:
        if self.echo:
            raise RequestError("echo is not supported", param="echo")
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of other than n is not supported", param="best_of")
        fields: dict[str, Any] = {"max_tokens": self.max_tokens}
        p = self.prompt
        if isinstance(p, str):
            fields["prompt"] = p
        elif p and all(isinstance(x, int) for x in p):
            fields["prompt_token_ids"] = p
        elif len(p) == 1:
            fields["prompt"] = p[0]
        else:
            raise RequestError("prompt must be one string or one list of token ids (send one request per prompt)",
                               param="prompt")
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
        return fields


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = None  # None: until the model stops or the context is full
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def job_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "messages": [m.flat() for m in self.messages],
            "max_tokens": self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
        }
        k = chat_logprobs_k(self.logprobs, self.top_logprobs)
        if k is not None:
            fields["logprobs"] = k
        return fields

    @staticmethod
    def param_of(loc: str | None) -> str | None:
        # the job's ``logprobs`` (a count) is chat's ``top_logprobs``
        param = OpenAIRequest.param_of(loc)
        return "top_logprobs" if param == "logprobs" else param


def first_error_loc(exc: ValidationError) -> str | None:
    errs = exc.errors()
    loc = errs[0].get("loc") if errs else None
    return ".".join(str(x) for x in loc) if loc else None


# ---- stream chunks ---------------------------------------------------------------------------

def completion_chunk(rid: str, model: str, created: int, index: int, text: str | None, reason: str | None = None,
                     logprobs: dict | None = None) -> dict:
    choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason(reason), "text": text or ""}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(rid: str, model: str, created: int, index: int, text: str | None, reason: str | None = None,
               logprobs: dict | None = None, role: bool = False) -> dict:
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason(reason), "delta": delta}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(obj: str, rid: str, model: str, created: int, result: JobResult) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(result)}


def model_list(models: list[str]) -> dict:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": int(time.time()), "owned_by": "pagestream"}
                                       for m in models]}
