"""A tolerant scanner over JSON text that may still be growing (a model's output, token by token).

It never decodes the arguments: it finds where a tool call object's ``name`` and ``arguments``
(or ``parameters``) values lie in the raw text, so a stream can send the arguments as the model
wrote them, fragment by fragment, and the fragments add up to exactly what the whole text gives.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\r\n"
#: the keys a call object's arguments go by (hermes and mistral say arguments, llama3 parameters)
ARGUMENT_KEYS = ("arguments", "parameters")


def skip_ws(t: str, i: int) -> int:
    while i < len(t) and t[i] in _WS:
        i += 1
    return i


def string_end(t: str, i: int) -> int | None:
    """End (exclusive) of the JSON string opening at ``t[i]``; None while it is still open."""
    j = i + 1
    while j < len(t):
        c = t[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(t: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``t[i]``; None while the text may still extend it."""
    c = t[i]
    if c == '"':
        return string_end(t, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(t):
            ch = t[j]
            if ch == '"':
                e = string_end(t, j)
                if e is None:
                    return None
                j = e
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(t) and t[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(t) else None  # a number or literal at the text's end may go on


@dataclass
class CallScan:
    """One call object as far as the text goes: its name once its string closed, its arguments' raw text so far."""

    name: str | None = None
    arguments: str = ""
    args_complete: bool = False
    end: int | None = None  # past the closing brace, once seen
    bad: bool = False  # not a call object (not JSON, or a name that is not a string)
    has_args: bool = False

    @property
    def complete(self) -> bool:
        return self.end is not None

    def final_arguments(self) -> str:
        return self.arguments if self.has_args else "{}"


def scan_call(t: str, i: int) -> CallScan:
    """The call object opening at ``t[i]`` (``{"name": ..., "arguments": {...}}``)."""
    out = CallScan()
    j = i + 1
    while True:
        j = skip_ws(t, j)
        if j >= len(t):
            return out
        c = t[j]
        if c == "}":
            out.end = j + 1
            return out
        if c == ",":
            j += 1
            continue
        if c != '"':
            out.bad = True
            return out
        ke = string_end(t, j)
        if ke is None:
            return out
        key = json.loads(t[j:ke])
        j = skip_ws(t, ke)
        if j >= len(t):
            return out
        if t[j] != ":":
            out.bad = True
            return out
        j = skip_ws(t, j + 1)
        if j >= len(t):
            return out
        ve = value_end(t, j)
        if key == "name":
            if t[j] != '"':
                out.bad = True
                return out
            if ve is not None:
                out.name = json.loads(t[j:ve])
        elif key in ARGUMENT_KEYS and not out.has_args:
            out.has_args = True
            out.arguments = t[j:ve] if ve is not None else t[j:]
            out.args_complete = ve is not None
        if ve is None:
            return out
        j = ve


@dataclass
class SeqScan:
    calls: list[CallScan] = field(default_factory=list)
    end: int | None = None  # where the sequence stopped (a closing bracket, or text that is no call)


def scan_calls(t: str, i: int, separators: str) -> SeqScan:
    """Call objects from ``t[i]`` on, apart by whitespace and ``separators`` (``,`` in an array, ``;`` for llama3);
    stops at anything else (a closing ``]``)."""
    out = SeqScan()
    j = i
    while True:
        j = skip_ws(t, j)
        while j < len(t) and t[j] in separators:
            j = skip_ws(t, j + 1)
        if j >= len(t):
            return out
        if t[j] != "{":
            out.end = j
            return out
        call = scan_call(t, j)
        out.calls.append(call)
        if call.bad or not call.complete:
            return out
        j = call.end


def held_prefix(text: str, token: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``token`` (held back from content)."""
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-k:]):
            return k
    return 0
