"""The tool-call formats models write, one parser each, under vLLM's ``--tool-call-parser`` names;
and the two pagestream reads back from constrained decoding (``required``, a named tool)."""
from __future__ import annotations

from pagestream.producer.protocol.tool_parsers.base import Extracted, Scan, ToolCall, ToolParser
from pagestream.producer.protocol.tool_parsers.scan import (CallScan, held_prefix, scan_call, scan_calls, skip_ws,
                                                            value_end)


def _content_before(text: str, token: str, final: bool) -> str:
    """The text when ``token`` is not in it, less a tail that may be its start (unless ``final``)."""
    return text if final else text[:len(text) - held_prefix(text, token)]


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block a call;
    content is the text before the first block (text between and after blocks is dropped, as vLLM does)."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        k = text.find(self.start)
        if k < 0:
            return Scan(_content_before(text, self.start, final), [])
        calls: list[CallScan] = []
        at = k
        while at >= 0:
            body_at = at + len(self.start)
            e = text.find(self.end, body_at)
            body = text[body_at:] if e < 0 else text[body_at:e]
            b = skip_ws(body, 0)
            if b < len(body):
                call = scan_call(body, b) if body[b] == "{" else CallScan(bad=True)
                if e >= 0 and not call.complete:
                    call.bad = True
                calls.append(call)
                if call.bad:
                    break
            elif e >= 0:
                calls.append(CallScan(bad=True))  # an empty block
                break
            if e < 0:
                break
            at = text.find(self.start, e + len(self.end))
        return Scan(text[:k], calls)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}``, maybe after ``<|python_tag|>``,
    several apart by ``;``. Output that starts otherwise is content (as vLLM reads it)."""

    name = "llama3_json"
    bot = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        lead = skip_ws(text, 0)
        rest = text[lead:]
        if rest.startswith(self.bot):
            start = lead + len(self.bot)
        elif rest.startswith("{"):
            start = lead
        elif not final and self.bot.startswith(rest):
            return Scan("", [])  # not decided yet: nothing or the tag's start
        else:
            return Scan(text, [])
        return Scan("", scan_calls(text, start, ";").calls)


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (or the newer
    ``[TOOL_CALLS]name[ARGS]{...}``, repeated); content is the text before ``[TOOL_CALLS]``."""

    name = "mistral"
    bot, args_token = "[TOOL_CALLS]", "[ARGS]"

    def scan(self, text: str, final: bool) -> Scan:
        k = text.find(self.bot)
        if k < 0:
            return Scan(_content_before(text, self.bot, final), [])
        j = skip_ws(text, k + len(self.bot))
        if j >= len(text):
            return Scan(text[:k], [])
        if text[j] == "[":
            return Scan(text[:k], scan_calls(text, j + 1, ",").calls)
        if text[j] == "{":
            return Scan(text[:k], scan_calls(text, j, ",").calls)
        return Scan(text[:k], self._named_calls(text, k))

    def _named_calls(self, text: str, at: int) -> list[CallScan]:
        calls: list[CallScan] = []
        while at >= 0:
            j = at + len(self.bot)
            a = text.find(self.args_token, j)
            if a < 0:
                break  # the name is still coming
            s = skip_ws(text, a + len(self.args_token))
            call = CallScan(name=text[j:a].strip())
            calls.append(call)
            if s >= len(text):
                break
            if text[s] != "{":
                call.bad = True
                break
            ve = value_end(text, s)
            call.has_args, call.arguments, call.args_complete, call.end = True, text[s:ve], ve is not None, ve
            if ve is None:
                call.arguments = text[s:]
                break
            at = text.find(self.bot, ve)
        return calls


class RequiredToolParser(ToolParser):
    """``tool_choice="required"``: the output was constrained to ``[{"name": ..., "parameters": {...}}, ...]``."""

    name = "required"
    fallback_to_text = False

    def scan(self, text: str, final: bool) -> Scan:
        j = skip_ws(text, 0)
        if j >= len(text) or text[j] != "[":
            return Scan("", [])
        return Scan("", scan_calls(text, j + 1, ",").calls)


class NamedToolParser(ToolParser):
    """A named ``tool_choice``: the output was constrained to that tool's arguments."""

    name = "named"
    fallback_to_text = False

    def __init__(self, tool_name: str) -> None:
        super().__init__()
        self.tool_name = tool_name

    def scan(self, text: str, final: bool) -> Scan:
        call = CallScan(name=self.tool_name, arguments=text, has_args=bool(text), args_complete=final,
                        end=len(text) if final else None)
        return Scan("", [call])

    def extract(self, text: str) -> Extracted:
        return Extracted(None, [ToolCall(self.tool_name, text)])  # as vLLM: the text is the arguments
