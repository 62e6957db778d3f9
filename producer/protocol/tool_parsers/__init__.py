"""Tool-call parsers: a model's text in, OpenAI ``tool_calls`` out, whole or as stream deltas.

Pure classes (no I/O), in the contract because a bulk's output lines will carry the same answers as the
gateway. ``TOOL_PARSERS`` names them as vLLM's ``--tool-call-parser`` does.
"""
from __future__ import annotations

from pagestream.producer.protocol.tool_parsers.base import Extracted, ToolCall, ToolParser, merge_deltas, tool_call_id
from pagestream.producer.protocol.tool_parsers.formats import (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                                               NamedToolParser, RequiredToolParser)

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}

__all__ = ["TOOL_PARSERS", "Extracted", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "NamedToolParser", "RequiredToolParser", "ToolCall", "ToolParser", "merge_deltas", "tool_call_id"]
