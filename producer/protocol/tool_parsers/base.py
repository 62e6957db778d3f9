"""What every tool-call parser shares: a scan of the text so far, turned into a whole answer or stream deltas.

A parser's only job is ``scan(text, final)``: the content so far (with any tail that may be the start of
its call marker held back, unless ``final``) and the calls so far (``scan.CallScan``). ``extract`` reads
the whole text once; ``extract_streaming`` scans the grown text and sends what the last scan had not
(content, then per call its id and name first, then argument fragments), so the deltas of a stream add up
to what ``extract`` gives for the same text, however the text was split. One parser instance per stream.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagestream.producer.protocol.tool_parsers.scan import CallScan


def tool_call_id() -> str:
    """vLLM's id for a call: ``chatcmpl-tool-<32 hex>``."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Extracted:
    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class Scan:
    content: str
    calls: list[CallScan]


@dataclass
class _Sent:
    id: str
    args: int = 0


class ToolParser:
    """Subclasses set ``name`` and write ``scan``."""

    name: ClassVar[str]
    #: text whose calls do not parse is answered as content (auto); constrained output never falls back
    fallback_to_text: ClassVar[bool] = True

    def __init__(self) -> None:
        self._content_sent = 0
        self._sent: list[_Sent] = []

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    # -- whole text -----------------------------------------------------------------------------

    def extract(self, text: str) -> Extracted:
        s = self.scan(text, final=True)
        calls = []
        for c in s.calls:
            if c.bad or not c.complete or c.name is None or not _is_json(c.final_arguments()):
                if self.fallback_to_text:
                    return Extracted(text, [])  # as vLLM: a call that does not parse is the model's text
                break
            calls.append(ToolCall(c.name, c.final_arguments()))
        if not calls and self.fallback_to_text:
            return Extracted(text, [])
        return Extracted(s.content or None, calls)

    # -- a stream -------------------------------------------------------------------------------

    def extract_streaming(self, previous_text: str, delta_text: str) -> list[dict[str, Any]]:
        """The deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) that ``delta_text`` adds."""
        return self._diff(self.scan(previous_text + delta_text, final=False))

    def finish(self, text: str) -> list[dict[str, Any]]:
        """The last deltas once ``text`` is the whole output: held-back content, or all of it as content
        when it held no call that parses."""
        out = self._diff(self.scan(text, final=True))
        if not self._sent and self.fallback_to_text:
            rest = text[self._content_sent:]
            if rest:
                out.append({"content": rest})
                self._content_sent = len(text)
        return out

    @property
    def called(self) -> bool:
        """Whether the stream sent a call."""
        return bool(self._sent)

    def _diff(self, s: Scan) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if len(s.content) > self._content_sent:
            out.append({"content": s.content[self._content_sent:]})
            self._content_sent = len(s.content)
        for index, call in enumerate(s.calls):
            if call.bad:
                break
            if index == len(self._sent):
                if call.name is None:
                    break  # a call's name goes first
                self._sent.append(_Sent(tool_call_id()))
                out.append({"tool_calls": [{"index": index, "id": self._sent[index].id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            sent = self._sent[index]
            args = call.final_arguments() if call.complete else call.arguments
            if len(args) > sent.args:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": args[sent.args:]}}]})
                sent.args = len(args)
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Deltas of one step as one chunk's delta: content joined, a call's fragments joined under its index."""
    if not deltas:
        return None
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            have = calls.get(tc["index"])
            if have is None:
                calls[tc["index"]] = {**tc, "function": dict(tc["function"])}
            else:
                have["function"]["arguments"] = have["function"].get("arguments", "") + tc["function"].get("arguments", "")
    out: dict[str, Any] = {}
    if content:
        out["content"] = content
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out or None
