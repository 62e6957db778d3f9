"""LiteLLM and LangChain for the client tests, imported when a test first uses them.

Importing litellm takes ~4-5 s of CPU (langchain-openai ~1-2 s more). At module level every
xdist process paid it while collecting, though only the process that runs test_clients_compat
or test_clients_tools uses them. A missing library still skips the module at collection, as
``pytest.importorskip`` did. Both libraries are kept off the network (LiteLLM reads its bundled
model map and sends no telemetry; LangSmith tracing is off): the variables are set before either
is imported.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

OFFLINE = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_OFFLINE_MODE": "true", "LITELLM_TELEMETRY": "False",
           "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false"}


def _quiet_litellm(mod: ModuleType) -> None:
    mod.telemetry = False
    mod.suppress_debug_info = True  # its "Give Feedback" banner on every exception


class LazyModule:
    """A module imported at its first attribute access (then ``after(module)`` runs once)."""

    def __init__(self, name: str, after: Callable[[ModuleType], None] | None = None) -> None:
        self._name, self._after, self._mod = name, after, None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_") or attr == "pytestmark":  # what pytest's collector asks of every module-level name
            raise AttributeError(attr)
        if self._mod is None:
            for k, v in OFFLINE.items():
                os.environ.setdefault(k, v)
            mod = importlib.import_module(self._name)
            if self._after is not None:
                self._after(mod)
            self._mod = mod
        return getattr(self._mod, attr)


def require(*names: str) -> None:
    """Skip the calling module at collection when one of ``names`` is not installed (no import)."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"could not import {name!r}", allow_module_level=True)


require("litellm", "langchain_openai")
litellm = LazyModule("litellm", after=_quiet_litellm)
langchain_openai = LazyModule("langchain_openai")
langchain_messages = LazyModule("langchain_core.messages")
