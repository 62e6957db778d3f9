"""Tool-call parsers: a model's text in, OpenAI ``tool_calls`` out, whole or as stream deltas.

Pure classes (no I/O), in the contract because a bulk's output lines will carry the same answers as the
gateway. ``TOOL_PARSERS`` names them as vLLM's ``--tool-call-parser`` does.
"""
from __future__ import annotations

from pagestream.producer.protocol.tool_parsers.base import Extracted, ToolCall, ToolParser, merge_deltas, tool_call_id
from pagestream.producer.protocol.tool_parsers.formats import (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                                               NamedToolParser, RequiredToolParser)

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def known_parser(name: str | None) -> str | None:
    """``name`` if a parser has it (or None: no parser); a ValueError naming the choices otherwise (the
    gateway's ``--tool-call-parser`` and a bulk's setting are checked alike)."""
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser {name!r} is not one of {sorted(TOOL_PARSERS)}")
    return name


__all__ = ["TOOL_PARSERS", "known_parser", "Extracted", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "NamedToolParser", "RequiredToolParser", "ToolCall", "ToolParser", "merge_deltas", "tool_call_id"]
