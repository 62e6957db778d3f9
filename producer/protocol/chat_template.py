"""vLLM's chat-template options of a chat request, checked the same way on every surface (the job schema,
the gateway's chat completions and ``/tokenize``, bulk lines): ``add_generation_prompt``,
``continue_final_message``, ``chat_template`` (a Jinja template sent with the request: the gateway takes
it only with ``trust_request_chat_template``) and ``chat_template_kwargs`` (extra variables for the
template, e.g. ``{"enable_thinking": false}``).

The worker renders with transformers' ``apply_chat_template`` (a sandboxed Jinja environment);
``chat_template_kwargs`` go in as its extra keyword arguments, so they may not name one of the call's
own arguments (``engine.input_processor.RESERVED_TEMPLATE_ARGS`` is the same list on the engine's side).
"""
from __future__ import annotations

import json
from typing import Any

from pagestream.producer.protocol.limits import job_limits
from pagestream.producer.protocol.untrusted import UntrustedJSONError, check_json_tree

#: the arguments of ``apply_chat_template`` itself: ``chat_template_kwargs`` may not set them (a 400 naming the key)
RESERVED_TEMPLATE_ARGS = ("messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                          "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                          "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                          "tokenizer_kwargs")
#: nesting of ``chat_template_kwargs`` (the object itself is level 1)
MAX_TEMPLATE_KWARGS_DEPTH = 8

#: vLLM's words when a request carries a template and the server does not trust request templates
UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                      "Refused request with untrusted chat template. (Start the gateway with "
                      "--trust-request-chat-template or PAGESTREAM_GATEWAY_TRUST_REQUEST_CHAT_TEMPLATE=true to allow it.)")
BOTH_PROMPT_OPTIONS = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


def check_chat_template(value: str) -> str:
    """A request's template within ``max_chat_template_bytes``, as UTF-8 text (``ValueError`` otherwise)."""
    if not isinstance(value, str):
        raise ValueError("chat_template must be a string (a Jinja template)")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"chat_template is not valid UTF-8 text (position {exc.start})") from None
    limit = job_limits().max_chat_template_bytes
    if size > limit:
        raise ValueError(f"chat_template is {size} bytes; at most {limit} bytes allowed "
                         "(PAGESTREAM_MAX_CHAT_TEMPLATE_BYTES)")
    if not value.strip():
        raise ValueError("chat_template must not be empty")
    return value


def check_template_kwargs(value: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` as the template call takes them: a JSON object of string keys, none of them
    an argument of the call itself, nested at most ``MAX_TEMPLATE_KWARGS_DEPTH`` levels and within
    ``max_chat_template_kwargs_bytes`` as JSON (``ValueError`` naming what is wrong)."""
    if not isinstance(value, dict):
        raise ValueError(f"chat_template_kwargs must be a JSON object, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise ValueError(f"chat_template_kwargs keys must be strings, got {key!r}")
        if key in RESERVED_TEMPLATE_ARGS:
            raise ValueError(f"chat_template_kwargs may not set {key!r}: it is an argument of the template call "
                             f"itself{_where_instead(key)}")
    try:
        check_json_tree(value, MAX_TEMPLATE_KWARGS_DEPTH)
    except UntrustedJSONError as exc:
        raise ValueError(f"chat_template_kwargs: {exc}") from None
    try:
        size = _json_bytes(value)
    except (TypeError, ValueError):
        raise ValueError("chat_template_kwargs must hold JSON values only") from None
    limit = job_limits().max_chat_template_kwargs_bytes
    if size > limit:
        raise ValueError(f"chat_template_kwargs is {size} bytes as JSON; at most {limit} bytes allowed "
                         "(PAGESTREAM_MAX_CHAT_TEMPLATE_KWARGS_BYTES)")
    return value


def _where_instead(key: str) -> str:
    if key in ("add_generation_prompt", "continue_final_message", "chat_template", "tools"):
        return f" (set the request's own `{key}` field)"
    if key in ("messages", "conversation"):
        return " (the request's `messages`)"
    return ""


def template_options(add_generation_prompt: bool, continue_final_message: bool, chat_template: str | None,
                     chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The job fields of a chat request's template options: only those other than the defaults, so a job
    without them is what it was before they existed (``ValueError`` for both prompt options on)."""
    if add_generation_prompt and continue_final_message:
        raise ValueError(BOTH_PROMPT_OPTIONS)
    fields: dict[str, Any] = {}
    if not add_generation_prompt:
        fields["add_generation_prompt"] = False
    if continue_final_message:
        fields["continue_final_message"] = True
    if chat_template is not None:
        fields["chat_template"] = chat_template
    if chat_template_kwargs:
        fields["chat_template_kwargs"] = chat_template_kwargs
    return fields
