"""Routing by model, the worker's side: announce the served model while alive.

A worker started with ``served_model_name`` reads only that model's lanes
(``keys.jobs_stream(lane, model)``, chosen in ``Consumer.stream``) and keeps its
name in the registry (``keys.model_registry()``: a sorted set scored by the unix
ms until which the announcement holds). Producers refuse jobs for models nobody
announced; a worker that dies stops being counted once its announcement expires.
"""
from __future__ import annotations

import json
import logging
import threading
import time

import redis

from pagestream.producer.protocol import keys

log = logging.getLogger(__name__)


def announce(client: redis.Redis, model: str, ttl_s: float, max_model_len: int | None = None,
             vocab_size: int | None = None, root: str | None = None, chat_tools: bool | None = None) -> None:
    """Say ``model`` is served for the next ``ttl_s`` seconds (never shortens another worker's claim), with its
    context length and vocabulary size (the gateway checks token ids and lengths against them before submitting)
    and ``root``, the model path it loaded (the model object's ``root`` on ``/v1/models``); ``chat_tools``: whether its
    chat template renders ``tools`` (the gateway refuses tools for a model whose template has no tool format)."""
    pipe = client.pipeline(transaction=False)
    pipe.zadd(keys.model_registry(), {model: int((time.time() + ttl_s) * 1000)}, gt=True)
    pipe.hset(keys.model_info(), model, json.dumps({"max_model_len": max_model_len, "vocab_size": vocab_size,
                                                             "root": root, "chat_tools": chat_tools}))
    pipe.execute()


class ModelAnnouncer(threading.Thread):
    """Re-announces every ``ttl_s / 3`` seconds until ``stop()``; rides out Redis errors."""

    def __init__(self, client: redis.Redis, model: str, ttl_s: float = 10.0, max_model_len: int | None = None,
                 vocab_size: int | None = None, root: str | None = None, chat_tools: bool | None = None) -> None:
        super().__init__(name=f"announce-{model}", daemon=True)
        self.client, self.model, self.ttl_s, self.max_model_len = client, model, ttl_s, max_model_len
        self.vocab_size, self.root, self.chat_tools = vocab_size, root, chat_tools
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                announce(self.client, self.model, self.ttl_s, self.max_model_len, self.vocab_size, self.root,
                         self.chat_tools)
            except redis.RedisError as exc:
                log.warning("could not announce model %s: %s", self.model, exc)
            self._stop_event.wait(self.ttl_s / 3)

    def stop(self) -> None:
        self._stop_event.set()


def start_announcer(client: redis.Redis, settings, engine) -> ModelAnnouncer | None:
    """Start announcing the worker's served model (None when it serves the shared lanes)."""
    if not settings.served_model_name:
        return None
    max_len = getattr(engine, "max_model_len", None)
    if max_len is None:  # the fake engine keeps it in its config
        max_len = getattr(getattr(engine, "config", None), "max_model_len", None)
    vocab = getattr(getattr(engine, "limits", None), "vocab_size", None)  # LLMEngine and the engine-process client
    if vocab is None:
        vocab = getattr(getattr(engine, "config", None), "vocab_size", None)
    from pagestream.engine.input_processor import template_has_tools

    announcer = ModelAnnouncer(client, settings.served_model_name, max_model_len=max_len if isinstance(max_len, int) else None,
                               vocab_size=vocab if isinstance(vocab, int) else None, root=settings.model,
                               chat_tools=template_has_tools(getattr(engine, "tokenizer", None)))
    announcer.start()
    return announcer
