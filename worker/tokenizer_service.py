"""The worker's tokenizer, served to the gateway: ``/tokenize``, ``/detokenize``, ``/tokenizer_info``.

One daemon thread pops calls from ``keys.tokenizer_calls(model)`` and pushes each reply onto its
``keys.tokenizer_reply`` key (``producer.protocol.tokenization`` is the contract). It runs beside the
engine loop and never touches the engine itself, only its tokenizer (HF's, or the fake engine's).
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import redis

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.chat_template import check_chat_template, check_template_kwargs
from pagestream.producer.protocol.tokenization import (REPLY_TTL_S, TokenizerCall, TokenizerOp, error_reply,
                                                       ok_reply)

log = logging.getLogger(__name__)

#: how long one BRPOP waits before the thread looks at its stop flag again
POLL_S = 1.0


def _ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError("tokens must be a list of integers")
    return value


def _json_able(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool)) or (
        isinstance(value, (list, tuple)) and all(_json_able(v) for v in value)) or (
        isinstance(value, dict) and all(isinstance(k, str) and _json_able(v) for k, v in value.items()))


def _plain(value: Any) -> Any:
    """A tokenizer config value as vLLM's ``/tokenizer_info`` writes it: a special token (``AddedToken``) as its
    text, dicts and lists item by item (a dict's int keys, ``added_tokens_decoder``'s, as JSON writes them)."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k) if isinstance(k, int) else k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def tokenizer_info(tokenizer) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info`` body (``serve/tokenize/serving.py``, ``TokenizerInfo``): the tokenizer's
    ``init_kwargs`` (its tokenizer_config.json) without the file paths (``vocab_file``, ``merges_file``), special
    tokens as their text, ``tokenizer_class`` the tokenizer's class name and ``chat_template`` the template the
    worker renders chats with. A value JSON cannot hold is left out (vLLM would fail the whole answer)."""
    init = dict(getattr(tokenizer, "init_kwargs", None) or {})
    init.pop("vocab_file", None)
    init.pop("merges_file", None)
    info = {k: v for k, v in _plain(init).items() if _json_able(v)}
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    return info


def answer(tokenizer, call: TokenizerCall) -> dict[str, Any]:
    """The result of ``call`` with ``tokenizer``; ``ValueError`` (or the tokenizer's own error) for a bad call."""
    a = call.args
    if call.op is TokenizerOp.DETOKENIZE:
        return {"prompt": tokenizer.decode(_ids(a.get("tokens")))}
    if call.op is TokenizerOp.INFO:
        return tokenizer_info(tokenizer)
    if call.op is TokenizerOp.TOKENIZE_CHAT:
        # vLLM renders the template to text, then encodes it (add_special_tokens defaults to false: the
        # template already holds the special tokens)
        kw: dict[str, Any] = {"tools": a["tools"]} if a.get("tools") else {}
        if a.get("chat_template") is not None:
            kw["chat_template"] = check_chat_template(a["chat_template"])
        extra = check_template_kwargs(a["chat_template_kwargs"]) if a.get("chat_template_kwargs") else {}
        text = tokenizer.apply_chat_template(a["messages"], tokenize=False,
                                             add_generation_prompt=bool(a.get("add_generation_prompt", True)),
                                             continue_final_message=bool(a.get("continue_final_message", False)),
                                             **kw, **extra)
        add_special = bool(a.get("add_special_tokens", False))
    else:
        text = a.get("prompt")
        if not isinstance(text, str):
            raise ValueError("prompt must be a string")
        add_special = bool(a.get("add_special_tokens", True))
    tokens = list(tokenizer.encode(text, add_special_tokens=add_special))
    strs = list(tokenizer.convert_ids_to_tokens(tokens)) if a.get("return_token_strs") else None
    return {"tokens": tokens, "token_strs": strs}


class TokenizerService(threading.Thread):
    """Answers ``model``'s tokenizer calls until ``stop()``; rides out Redis errors."""

    def __init__(self, client: redis.Redis, model: str, tokenizer) -> None:
        super().__init__(name=f"tokenizer-{model}", daemon=True)
        self.client, self.model, self.tokenizer = client, model, tokenizer
        self._stop_event = threading.Event()

    def handle(self, raw: bytes) -> None:
        try:
            call = TokenizerCall.loads(raw)
        except (ValueError, TypeError) as exc:
            log.warning("dropped a malformed tokenizer call: %s", exc)
            return
        if call.expired():  # its caller already answered 503
            return
        try:
            reply = ok_reply(answer(self.tokenizer, call))
        except Exception as exc:  # the tokenizer refused the input (bad ids, a template error): the client's 400
            reply = error_reply(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc))
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(keys.tokenizer_reply(call.id), reply)
        pipe.expire(keys.tokenizer_reply(call.id), REPLY_TTL_S)
        pipe.execute()

    def run(self) -> None:
        calls = keys.tokenizer_calls(self.model)
        while not self._stop_event.is_set():
            try:
                popped = self.client.brpop([calls], timeout=POLL_S)
                if popped is not None:
                    self.handle(popped[1])
            except redis.RedisError as exc:
                log.warning("tokenizer service for %s: %s", self.model, exc)
                self._stop_event.wait(POLL_S)

    def stop(self) -> None:
        self._stop_event.set()


def start_tokenizer_service(client: redis.Redis, settings, engine) -> TokenizerService | None:
    """Serve the engine's tokenizer for the worker's served model (None: shared lanes, or no tokenizer)."""
    tokenizer = getattr(engine, "tokenizer", None)
    if not settings.served_model_name or tokenizer is None:
        return None
    service = TokenizerService(client, settings.served_model_name, tokenizer)
    service.start()
    return service
