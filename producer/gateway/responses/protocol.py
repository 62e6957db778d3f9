"""``/v1/responses``' request and its objects (no I/O here).

A Responses request is read onto the chat job path: ``instructions`` become the system message, ``input``
(text or items: messages, ``function_call`` and ``function_call_output``) follows the stored conversation of
``previous_response_id``, ``tools`` of type ``function`` and ``tool_choice`` become chat's, ``text.format``
becomes ``response_format`` (structured outputs), ``max_output_tokens`` ``max_tokens``. vLLM's
``serving_responses.py`` is the behaviour reference. A field this server cannot honour is a 400 naming it
before anything is queued, never silently dropped.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from pagestream.producer.gateway.protocol import ChatCompletionRequest
from pagestream.producer.protocol.errors import RequestError

#: OpenAI fields accepted and not acted on: none changes what is generated
_HINTS = ("user", "safety_identifier", "prompt_cache_key", "service_tier", "stream_options")
#: OpenAI fields this server does not implement: a 400 when given a value other than these (their "off")
_UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "include": (None, []), "reasoning": (None,), "top_logprobs": (None, 0),
    "max_tool_calls": (None,), "prompt": (None,), "conversation": (None,), "truncation": (None, "disabled"),
    "context_management": (None,), "prompt_cache_retention": (None,),
}


class FunctionTool(BaseModel):
    """A Responses ``function`` tool (flat: ``name`` and ``parameters`` beside ``type``)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters, "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}

    def as_output(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Unknown fields are refused (400 naming them), as are known ones set to
    something this server does not do (``reasoning``, ``include``, ...)."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = None
    # vLLM's sampling extensions (extra_body)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def refuse_unsupported(self) -> None:
        for name in sorted(self.model_extra or {}):
            value = (self.model_extra or {})[name]
            if name in _HINTS:
                continue
            if name in _UNSUPPORTED_UNLESS:
                if value in _UNSUPPORTED_UNLESS[name]:
                    continue
                raise RequestError(f"`{name}` is not supported by this server (got {value!r})", param=name)
            raise RequestError(f"unknown field `{name}` for /v1/responses", param=name)

    def function_tools(self) -> list[FunctionTool]:
        out = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise RequestError(f"only tools of type 'function' are supported, got {tool.get('type')!r}",
                                   param=f"tools.{i}.type")
            try:
                out.append(FunctionTool.model_validate(tool))
            except ValueError as exc:
                raise RequestError(f"tools.{i}: {exc}", param=f"tools.{i}") from None
        return out

    def chat_tool_choice(self) -> Any:
        tc = self.tool_choice
        if tc is None or tc in ("none", "auto", "required"):
            return tc
        if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
            return {"type": "function", "function": {"name": tc["name"]}}
        raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, "
                           f"got {tc!r}", param="tool_choice")

    def response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        extra = set(self.text or {}) - {"format", "verbosity"}
        if extra:
            raise RequestError(f"text.{sorted(extra)[0]} is not supported", param="text")
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            return {"type": "json_schema", "json_schema": inner}
        raise RequestError(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {fmt.get('type')!r}",
                           param="text.format")

    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                messages.append(_message(item, i))
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                    last["tool_calls"].append(call)  # consecutive calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                if not isinstance(output, str):
                    raise RequestError("function_call_output.output must be a string", param=f"input.{i}.output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
            else:
                raise RequestError(f"input items of type {kind!r} are not supported (message, function_call, "
                                   "function_call_output are)", param=f"input.{i}.type")
        if not messages:
            raise RequestError("input cannot be empty", param="input")
        return messages

    def to_chat(self, history: list[dict[str, Any]]) -> tuple[ResponsesChatRequest, list[dict[str, Any]]]:
        """The chat request this one runs as, and the conversation it continues with this input (what a later
        ``previous_response_id`` continues, this answer's message to come; ``instructions`` are not carried over,
        as OpenAI does)."""
        self.refuse_unsupported()
        if self.background and not self.store:  # a background response is read back: it must be kept
            raise RequestError("background mode requires store=true (a background response is retrieved by its id)",
                               param="store")
        tools = self.function_tools()
        conversation = [*history, *self.input_messages()]
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {"model": self.model, "messages": system + conversation, "stream": self.stream,
                                "max_tokens": self.max_output_tokens}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if tools:
            body["tools"] = [t.chat() for t in tools]
        choice = self.chat_tool_choice()
        if choice is not None:
            body["tool_choice"] = choice
        fmt = self.response_format()
        if fmt is not None:
            body["response_format"] = fmt
        chat = ResponsesChatRequest.model_validate(body)
        chat._responses = self
        chat._conversation = conversation
        return chat, conversation


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestError(f"message role must be user, system, developer or assistant, got {role!r}",
                           param=f"input.{i}.role")
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"only text content is supported, got {kind!r}", param=f"input.{i}.content.{j}")
            parts.append(part.get("text") or "")
        content = "".join(parts)
    elif not isinstance(content, str):
        raise RequestError("message content must be a string or a list of text parts", param=f"input.{i}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses request runs as, carrying the Responses request it came from."""

    _responses: ResponsesRequest = PrivateAttr()
    _conversation: list[dict[str, Any]] = PrivateAttr()
    _owner: str = PrivateAttr(default="")  # the asking tenant's name, set when it is served
    #: a background response's request body and the conversation it continued (None: not in the background)
    _background: dict[str, Any] | None = PrivateAttr(default=None)

    @property
    def responses(self) -> ResponsesRequest:
        return self._responses

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return self._conversation


# ---- objects out ------------------------------------------------------------------------------

def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def response_object(rreq: ResponsesRequest, rid: str, created: int, output: list[dict[str, Any]], status: str,
                    usage: dict[str, int] | None = None, finish_reason: str | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's ``response`` object; ``incomplete`` with ``max_output_tokens`` when the model was cut off (a
    background one: ``queued`` / ``in_progress`` while its job runs, ``cancelled`` when cancelled)."""
    if status == "completed" and finish_reason == "length":
        status = "incomplete"
    tc = rreq.tool_choice if rreq.tool_choice is not None else ("auto" if rreq.tools else "none")
    return {
        "id": rid, "object": "response", "created_at": created, "model": rreq.model, "status": status,
        "output": output, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": rreq.instructions, "metadata": rreq.metadata or {},
        "parallel_tool_calls": True if rreq.parallel_tool_calls is None else rreq.parallel_tool_calls,
        "temperature": rreq.temperature, "top_p": rreq.top_p, "max_output_tokens": rreq.max_output_tokens,
        "previous_response_id": rreq.previous_response_id, "tool_choice": tc,
        "tools": [t.as_output() for t in rreq.function_tools()],
        "text": {"format": (rreq.text or {}).get("format") or {"type": "text"}},
        "truncation": "disabled", "store": rreq.store, "background": rreq.background, "usage": response_usage(usage),
        "completed_at": time.time() if status in ("completed", "incomplete") else None,
    }
