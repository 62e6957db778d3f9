"""Tools in ``/v1/chat/completions``: the checks a request's tools need against the server and the model,
and its answer's calls, whole (``message.tool_calls``) or streamed (``delta.tool_calls``).

``required`` and a named tool were constrained at decoding (``ToolUse.output_schema``); their output is read
back by ``RequiredToolParser`` / ``NamedToolParser``. ``auto`` output is read by the server's
``--tool-call-parser``. ``finish_reason`` is ``tool_calls`` when ``auto`` answered calls or ``required``
stopped on its own; a named tool keeps ``stop``, as vLLM answers.
"""
from __future__ import annotations

from typing import Any

from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.gateway.protocol import ChatCompletionRequest, chat_chunk
from pagestream.producer.gateway.settings import GatewaySettings
from pagestream.producer.protocol.tool_parsers import ToolParser, merge_deltas
from pagestream.producer.protocol.tools import AUTO_NEEDS_PARSER, ToolAnswer, ToolUse, no_tool_format


def check_tools(req: ChatCompletionRequest, settings: GatewaySettings, model_info: dict[str, Any]) -> None:
    """400 for tools this server or model cannot answer: ``auto`` without a parser (vLLM's message), tools for
    a model whose chat template has no tool format (its workers announce whether it renders ``tools``)."""
    use = req.tool_use()
    if use.choice == "auto" and not (settings.enable_auto_tool_choice and settings.tool_call_parser):
        raise GatewayError(400, AUTO_NEEDS_PARSER, param="tool_choice")
    if use.tools and model_info.get("chat_tools") is False:
        raise GatewayError(400, no_tool_format(req.model), param="tools")


def auto_tool_parser(settings: GatewaySettings) -> str | None:
    """The parser ``auto`` answers are read with (None: ``auto`` is refused); a batch created here keeps it."""
    return settings.tool_call_parser if settings.enable_auto_tool_choice else None


def answering(use: ToolUse, settings: GatewaySettings) -> ToolAnswer:
    """The reading of an active ``use``'s output (``check_tools`` has refused ``auto`` without a parser);
    the same ``ToolAnswer`` a bulk's output lines are written with (``producer.protocol.tools``)."""
    return use.answering(auto_tool_parser(settings))


def answer_calls(body: dict[str, Any], texts: dict[int, str], use: ToolUse, settings: GatewaySettings) -> None:
    """Each choice's message as calls (``content`` null unless the model wrote text before them)."""
    answering(use, settings).answer(body, texts)


class ToolCallStream:
    """A streamed request's chunker: each choice's text through its parser, chunks of ``delta.tool_calls``
    (index, then id, type and name, then argument fragments) and content outside calls."""

    def __init__(self, req: ChatCompletionRequest, rid: str, created: int, use: ToolUse, settings: GatewaySettings) -> None:
        self.req, self.rid, self.created, self.use, self.settings = req, rid, created, use, settings
        self.answer = answering(use, settings)
        self.parsers: dict[int, ToolParser] = {}
        self.texts: dict[int, str] = {}

    def __call__(self, index: int, text: str | None, reason: str | None = None,
                 logprobs: dict | None = None) -> dict[str, Any] | None:
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = self.answer.new_parser()
        before = self.texts.get(index, "")
        deltas = parser.extract_streaming(before, text) if text else []
        self.texts[index] = before + (text or "")
        if reason is not None:
            deltas += parser.finish(self.texts[index])
        delta = merge_deltas(deltas) or {}
        if not self.use.parallel_tool_calls and "tool_calls" in delta:
            delta["tool_calls"] = [tc for tc in delta["tool_calls"] if tc["index"] == 0]
            if not delta["tool_calls"]:
                del delta["tool_calls"]
        if not delta and reason is None and logprobs is None:
            return None
        chunk = chat_chunk(self.rid, self.req.model, self.created, index, None, reason, logprobs)
        choice = chunk["choices"][0]
        choice["delta"] = delta
        if reason is not None:
            choice["finish_reason"] = self.answer.finish_reason(parser.called, reason) or choice["finish_reason"]
        return chunk
