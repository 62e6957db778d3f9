"""OpenAI's shapes that more than one front end writes: chat messages in, completion bodies out.

The gateway answers ``/v1/completions`` and ``/v1/chat/completions`` with these bodies, and a
bulk (the Batch API) writes the same bodies into its output lines from the worker, so they live
in the contract. Plain data and pydantic only; no I/O.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from pagestream.producer.protocol.errors import RequestError
from pagestream.producer.protocol.schema import JobResult, SampleResult, TokenLogprob

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    """A chat message as OpenAI's clients send it (content: a string or text parts)."""

    model_config = ConfigDict(extra="ignore")

    role: str  # any role reaches the chat template (vLLM's behaviour); ``developer`` is read as ``system``
    content: str | list[ContentPart] | None = None
    # tools (issue 26): an assistant's calls, and the ``tool`` message answering one
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def flat(self) -> dict[str, Any]:
        """The job schema's message: text parts joined, ``developer`` as ``system`` (``RequestError`` for other parts);
        an assistant's ``tool_calls`` with their arguments as objects, as chat templates read them."""
        if isinstance(self.content, list):
            bad = [p.type for p in self.content if p.type != "text" or p.text is None]
            if bad:
                raise RequestError(f"only text content parts are supported, got {bad}", param="messages")
            text = "".join(p.text or "" for p in self.content)
        else:
            text = self.content or ""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            from pagestream.producer.protocol.tools import arguments_as_object

            calls = []
            for tc in self.tool_calls:
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RequestError("each tool_calls entry needs function.name", param="messages")
                calls.append({**tc, "function": {**fn, "arguments": arguments_as_object(fn.get("arguments", "{}"))}})
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def chat_logprobs_k(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """The job's ``logprobs`` for chat's pair of fields: ``logprobs: true`` asks for them,
    ``top_logprobs`` (default 0) says how many alternatives (the job schema checks the range)."""
    if top_logprobs is not None and not logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


def usage(result: JobResult, prompt_tokens_details: bool = False) -> dict[str, Any]:
    """vLLM's usage; with ``prompt_tokens_details`` (its --enable-prompt-tokens-details) and a prefix-cache hit,
    ``prompt_tokens_details.cached_tokens`` too (vLLM leaves it out, null, for a miss)."""
    body: dict[str, Any] = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                            "total_tokens": result.prompt_tokens + result.completion_tokens}
    return add_prompt_tokens_details(body, result.num_cached_tokens) if prompt_tokens_details else body


def add_prompt_tokens_details(body: dict[str, Any], cached_tokens: int) -> dict[str, Any]:
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def token_name(token_id: int, token: str, as_token_ids: bool) -> str:
    """A token as logprobs name it: its text, or ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``)."""
    return f"token_id:{token_id}" if as_token_ids else token


def chat_logprobs(lps: list[TokenLogprob], as_token_ids: bool = False) -> dict:
    """``choices[].logprobs`` of chat: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``."""
    content = []
    for t in lps:
        name = token_name(t.token_id, t.token, as_token_ids)
        tops = [token_name(a.token_id, a.token, as_token_ids) for a in t.top_logprobs]
        content.append({"token": name, "logprob": t.logprob, "bytes": _bytes(name),
                        "top_logprobs": [{"token": n, "logprob": a.logprob, "bytes": _bytes(n)}
                                         for n, a in zip(tops, t.top_logprobs)]})
    return {"content": content, "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], text_offset: int = 0, as_token_ids: bool = False) -> dict:
    """``choices[].logprobs`` of /v1/completions; ``text_offset`` of the first token (a stream continues it).

    ``top_logprobs`` holds the sampled token first, then the most likely alternatives (as vLLM's
    completions do: ``logprobs=0`` gives the sampled token's entry alone, ``logprobs=k`` up to k+1).
    Offsets add up the tokens' own texts, so a character split over two tokens counts
    each part's replacement character (as other servers that decode tokens alone do).
    """
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in lps:
        name = token_name(t.token_id, t.token, as_token_ids)
        if t.logprob is None:  # an echoed prompt's first token: nothing scores it (None, None as in vLLM)
            out["tokens"].append(name)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(text_offset)
            text_offset += len(t.token)
            continue
        top = {name: t.logprob}
        for a in t.top_logprobs:
            top.setdefault(token_name(a.token_id, a.token, as_token_ids), a.logprob)
        out["tokens"].append(name)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(t.token)
    return out


def prompt_logprobs_body(lps: list[TokenLogprob], as_token_ids: bool = False) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` field: None for the first prompt token, then per token
    ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` for the prompt's token and its top alternatives
    (``rank``: 1 for the most likely, as vLLM's; the prompt's own token has its rank only when it is among
    the alternatives, None otherwise)."""
    out: list[dict | None] = []
    for t in lps:
        if t.logprob is None:
            out.append(None)
            continue
        entry = {str(a.token_id): {"logprob": a.logprob, "rank": r,
                                   "decoded_token": token_name(a.token_id, a.token, as_token_ids)}
                 for r, a in enumerate(t.top_logprobs, start=1)}
        entry.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": None,
                                           "decoded_token": token_name(t.token_id, t.token, as_token_ids)})
        out.append(entry)
    return out


def _samples(result: JobResult) -> list[SampleResult]:
    # a result built by hand may carry only the top-level fields (sample 0)
    return result.outputs or [SampleResult(index=0, text=result.text, token_ids=result.token_ids,
                                           finish_reason=result.finish_reason)]


def chat_completion_body(rid: str, model: str, created: int, result: JobResult,
                         prompt_tokens_details: bool = False) -> dict[str, Any]:
    """A ``chat.completion`` object: one choice per sample."""
    choices = [{"index": s.index, "logprobs": None if s.logprobs is None else chat_logprobs(s.logprobs),
                "finish_reason": finish_reason(s.finish_reason), "message": {"role": "assistant", "content": s.text}}
               for s in _samples(result)]
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(result, prompt_tokens_details)}
    if result.prompt_logprobs is not None:  # vLLM's extension, on the response
        body["prompt_logprobs"] = prompt_logprobs_body(result.prompt_logprobs)
    return body


def text_completion_body(rid: str, model: str, created: int, result: JobResult) -> dict[str, Any]:
    """A ``text_completion`` object: one choice per sample."""
    choices = [{"index": s.index, "logprobs": None if s.logprobs is None else completion_logprobs(s.logprobs),
                "finish_reason": finish_reason(s.finish_reason), "text": s.text} for s in _samples(result)]
    if result.prompt_logprobs is not None:  # vLLM's extension, on each choice
        for c in choices:
            c["prompt_logprobs"] = prompt_logprobs_body(result.prompt_logprobs)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(result)}
