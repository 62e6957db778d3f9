"""The gateway's request and response models: OpenAI's fields in, OpenAI's objects out (no I/O here).

Requests are pydantic models that take OpenAI's fields; ``to_job`` turns one into a
``JobRequest`` (the job schema then checks ranges with the same rules every producer gets).
Responses are plain dicts in OpenAI's layout; the bodies a bulk writes too live in the
contract (``producer.protocol.openai``).
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagestream.producer.protocol.chat_template import UNTRUSTED_TEMPLATE, template_options
from pagestream.producer.protocol.errors import RequestError
from pagestream.producer.protocol.limits import job_limits
from pagestream.producer.protocol.openai import (ChatMessageIn, add_prompt_tokens_details, chat_logprobs_k, finish_reason,
                                                 usage)
from pagestream.producer.protocol.schema import JobRequest, JobResult
from pagestream.producer.protocol.tools import MAX_TOOLS, ChatTool, ToolChoice, ToolUse

_SAMPLING = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "top_k", "min_p",
             "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
             "include_stop_str_in_output", "prompt_logprobs", "logit_bias", "allowed_token_ids")
#: int64, the range vLLM's request models give ``seed``
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions that the engine has
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # OpenAI's token -> bias map; its keys are checked against the served vocabulary (see ``token_ids_to_check``)
    logit_bias: dict[str, float] | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    # per prompt token after the first, its logprob and this many alternatives (the response's ``prompt_logprobs``)
    prompt_logprobs: int | None = None
    # vLLM's: only these tokens may be sampled (checked against the served vocabulary)
    allowed_token_ids: list[int] | None = None
    # vLLM's: the prompt cut to its last k tokens ("right": its first k) right after the worker tokenizes it (a chat's
    # after its template; a token-id prompt at the gateway); -1: the model's context length. 0 is refused by the job
    # schema, more than the context by the gateway (``OpenAIServing.check_truncation``)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None

    def refuse_unsupported(self) -> None:
        if self.prompt_logprobs is not None:
            # vLLM's checks; -1 (the whole vocabulary) is not served: at most MAX_LOGPROBS alternatives
            if self.prompt_logprobs < 0:
                raise RequestError("`prompt_logprobs` must be a positive value (-1, the whole vocabulary, is not "
                                   "supported)", param="prompt_logprobs")
            if self.stream:
                raise RequestError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")

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
        from pagestream.producer.protocol.structured import removed_guided

        if (removed := removed_guided(lambda name: getattr(self, name, None))) is not None:
            raise RequestError(removed[1], param=removed[0])
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

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: usage on every chunk (it needs ``include_usage`` too, as in vLLM)."""
        return bool(self.stream_options and self.stream_options.include_usage and self.stream_options.continuous_usage_stats)

    def num_jobs(self) -> int:
        return 1

    def job_fields(self) -> list[dict[str, Any]]:
        """The request's own fields as JobRequest keyword fields, one dict per job (prompt or messages,
        max_tokens, logprobs): completions make one job per prompt."""
        raise NotImplementedError

    def logit_bias_ids(self) -> list[int]:
        """``logit_bias``'s keys as token ids for the vocabulary check; 400 naming the field for a key that is not a
        token id (not an integer, or negative) and for a value outside OpenAI's [-100, 100]."""
        ids = []
        for key, value in (self.logit_bias or {}).items():
            try:
                ids.append(int(key))
            except ValueError:
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            if ids[-1] < 0:
                raise RequestError(f"token_id(s) [{ids[-1]}] in logit_bias contain out-of-vocab token ids "
                                   "(a token id is not negative)", param="logit_bias")
            if not -100 <= value <= 100:
                raise RequestError(f"logit_bias values must be in [-100, 100], got {value} for token {key}",
                                   param="logit_bias")
        return ids

    def to_jobs(self, job_ids: list[str]) -> list[JobRequest]:
        """The jobs this request becomes (raises ``pydantic.ValidationError`` for out-of-range values)."""
        self.refuse_unsupported()
        self.logit_bias_ids()  # its 400s name the field, before the job schema's (``logit_bias.5``)
        common = {"model": self.model, **self.sampling(), **self.structured_fields(),
                  "return_prompt_token_ids": self.return_token_ids}
        if self.truncate_prompt_tokens is not None:  # the side means nothing without a count
            common.update(truncate_prompt_tokens=self.truncate_prompt_tokens, truncation_side=self.truncation_side)
        return [JobRequest.model_validate({"job_id": job_id, **common, **fields})
                for job_id, fields in zip(job_ids, self.job_fields(), strict=True)]

    @staticmethod
    def param_of(loc: str | None) -> str | None:
        """The request field a job-schema error location (``sampling.top_p``) is about."""
        return None if loc is None else loc.removeprefix("sampling.")


class CompletionRequest(OpenAIRequest):
    # OpenAI's four forms: one string, strings, one token-id list, token-id lists (one job per prompt)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    # a count; ``true`` is kept as sent so the job schema refuses it with a 400 that says so, not read as 1
    logprobs: bool | int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, in order (a string or a token-id list); 400 for an empty one."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif not p:
            raise RequestError("Prompt cannot be empty", param="prompt")
        elif all(isinstance(x, int) for x in p):
            prompts = [p]  # one prompt of token ids
        else:
            prompts = list(p)
        for x in prompts:
            if not x:
                raise RequestError("Prompt cannot be empty", param="prompt")
        return prompts

    def num_jobs(self) -> int:
        return len(self.prompts())

    def echoes_tokens(self, prompt: str | list[int]) -> bool:
        """Whether ``echo`` shows the prompt's tokens as the worker names them (a token-id prompt) rather than the
        prompt's text as sent. vLLM echoes a text prompt as sent even when ``truncate_prompt_tokens`` cut its ids
        (its renderer keeps the text and cuts only ``prompt_token_ids``), and echoes no prompt text at all with
        ``return_token_ids`` (the ids are in ``prompt_token_ids``; it does not detokenize them)."""
        return not isinstance(prompt, str) and not self.return_token_ids

    @property
    def echo_only(self) -> bool:
        """vLLM's echo without generation (``echo`` and ``max_tokens=0``, what lm-evaluation-harness's loglikelihood
        may send): the job samples one token, which the answer leaves out."""
        return self.echo and self.max_tokens == 0

    def echo_prompt_logprobs(self, prompt: str | list[int]) -> int | None:
        """The job's ``prompt_logprobs``: as asked; with echo, ``logprobs`` (vLLM's rule) and, for a token-id
        prompt, at least 0 (the worker names the prompt's tokens in them: the echoed text)."""
        k = self.prompt_logprobs
        if self.echo and k is None:
            if isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool):
                k = self.logprobs
            elif self.echoes_tokens(prompt):
                k = 0
        return k

    def job_fields(self) -> list[dict[str, Any]]:
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of other than n is not supported", param="best_of")
        out = []
        for p in self.prompts():
            fields: dict[str, Any] = {"max_tokens": 1 if self.echo_only else self.max_tokens}
            if isinstance(p, str):
                fields["prompt"] = p
            else:
                fields["prompt_token_ids"] = p
            if self.logprobs is not None:
                fields["logprobs"] = self.logprobs
            k = self.echo_prompt_logprobs(p)
            if k is not None:
                fields["prompt_logprobs"] = k
                # a streamed echo leads each choice's first chunk with them (vLLM's order): they come with the
                # job's first token event, not only with its result
                fields["stream_prompt_logprobs"] = self.echo and self.stream
            out.append(fields)
        return out


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = None  # None: until the model stops or the context is full
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's chat extensions
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # tools (issue 26: producer.protocol.tools, producer.gateway.chat.tools)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_use(self) -> ToolUse:
        return ToolUse.resolve(self.tools, self.tool_choice, self.parallel_tool_calls)

    def template_options(self) -> dict[str, Any]:
        """The job fields of vLLM's chat-template options (only those not at their default); the job schema
        checks ``chat_template`` and ``chat_template_kwargs`` (bounds, reserved keys). Whether a request's own
        template is trusted is the gateway's setting (``check_trusted_template``)."""
        try:
            return template_options(self.add_generation_prompt, self.continue_final_message, self.chat_template,
                                    self.chat_template_kwargs)
        except ValueError as exc:  # vLLM's own check, word for word
            raise RequestError(str(exc), param="continue_final_message") from None

    def job_fields(self) -> list[dict[str, Any]]:
        fields: dict[str, Any] = {
            "messages": [m.flat() for m in self.messages],
            "max_tokens": self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
            **self.template_options(),
        }
        k = chat_logprobs_k(self.logprobs, self.top_logprobs)
        if k is not None:
            fields["logprobs"] = k
        fields.update(self.tool_use().job_fields(self.response_format, self.structured_outputs))
        return [fields]

    def echo_text(self) -> str:
        """vLLM's chat ``echo``: the last message's content leads the reply when it is the reply's role."""
        if not self.echo:
            return ""
        last = self.messages[-1]
        return last.flat()["content"] if last.role == "assistant" else ""

    @staticmethod
    def param_of(loc: str | None) -> str | None:
        # the job's ``logprobs`` (a count) is chat's ``top_logprobs``
        param = OpenAIRequest.param_of(loc)
        return "top_logprobs" if param == "logprobs" else param


def check_trusted_template(chat_template: str | None, chat_template_kwargs: dict[str, Any] | None,
                           trusted: bool) -> None:
    """vLLM's ``--trust-request-chat-template``: a template sent with the request (``chat_template``, or
    ``chat_template`` inside ``chat_template_kwargs``, which vLLM reads too) is a 400 unless the gateway trusts them."""
    if trusted:
        return
    if chat_template is not None:
        raise RequestError(UNTRUSTED_TEMPLATE, param="chat_template")
    if isinstance(chat_template_kwargs, dict) and chat_template_kwargs.get("chat_template") is not None:
        raise RequestError(UNTRUSTED_TEMPLATE, param="chat_template_kwargs")


#: errors a 400 lists (then a count of the rest), as vLLM's 400s are short
MAX_LISTED_ERRORS = 5


def check_list_lengths(data: Any, max_choices: int) -> None:
    """The lists a body may hold, counted before any deep validation, so a million-item list costs a
    ``len`` and a one-line 400, not seconds of pydantic and a megabyte of errors."""
    if not isinstance(data, dict):
        return
    limits = job_limits()
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > max_choices:
        raise RequestError(f"prompt holds {len(prompt)} prompts; at most {max_choices} per request "
                           "(max_request_choices: prompts x n)", param="prompt")
    messages = data.get("messages")
    if isinstance(messages, list):
        if len(messages) > limits.max_messages:
            raise RequestError(f"messages holds {len(messages)} messages; at most {limits.max_messages} "
                               "(max_messages)", param="messages")
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and len(content) > limits.max_messages:
                raise RequestError(f"messages[{i}].content holds {len(content)} parts; at most "
                                   f"{limits.max_messages} (max_messages)", param=f"messages.{i}.content")
    tools = data.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise RequestError(f"tools holds {len(tools)} tools; at most {MAX_TOOLS}", param="tools")


def check_choices(req: OpenAIRequest, max_choices: int) -> None:
    """400 for a request whose prompts times ``n`` pass ``max_choices`` (both numbers named)."""
    prompts, n = req.num_jobs(), max(req.n, 1)
    if prompts * n > max_choices:
        raise RequestError(f"this request asks for {prompts} prompt(s) x n={n} = {prompts * n} completions; "
                           f"at most {max_choices} per request (max_request_choices)",
                           param="prompt" if prompts > 1 else "n")


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


def usage_chunk(obj: str, rid: str, model: str, created: int, results: list[JobResult],
                prompt_tokens_details: bool = False) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": total_usage(results, prompt_tokens_details)}


def total_usage(results: list[JobResult], prompt_tokens_details: bool = False) -> dict[str, Any]:
    """One request's usage over its jobs (one per prompt); with ``prompt_tokens_details``, the prompts' cached
    tokens summed (each prompt's once, whatever its n)."""
    parts = [usage(r) for r in results]
    body: dict[str, Any] = {k: sum(p[k] for p in parts) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    if prompt_tokens_details:
        add_prompt_tokens_details(body, sum(r.num_cached_tokens for r in results))
    return body


def model_card(model: str, info: dict) -> dict:
    """vLLM's model object: ``root`` is what the worker loaded (its model path), ``parent`` the base model of an
    adapter (none: pagestream serves no adapters), ``max_model_len`` the context the worker announced."""
    return {"id": model, "object": "model", "created": int(time.time()), "owned_by": "pagestream",
            "root": info.get("root") or model, "parent": None, "max_model_len": info.get("max_model_len")}


def model_list(models: dict[str, dict]) -> dict:
    return {"object": "list", "data": [model_card(m, models[m]) for m in sorted(models)]}
