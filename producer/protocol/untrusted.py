"""The one parser for JSON that crossed a trust boundary, and its tree check.

Lane entries, bulk input lines and job metadata all go through here. It imports
nothing from pagestream, so the schema (which checks metadata with it) and the
wire layout (which re-exports it) can both depend on it.
"""
from __future__ import annotations

import json
from typing import Any

#: nesting deeper than this in JSON read from Redis or a bulk input is refused (a job is ~4 deep)
MAX_JSON_DEPTH = 32


class UntrustedJSONError(ValueError):
    """JSON from outside (a stream entry, a bulk line) that pagestream will not take, and why."""


def _reject_constant(name: str) -> Any:
    raise UntrustedJSONError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e400 parses to inf: as unwritable as Infinity
        raise UntrustedJSONError(f"number {text[:40]} is out of range for a float")
    return value


def count_containers_past(raw: bytes, cap: int) -> bool:
    """Whether the JSON text ``raw`` opens more than ``cap`` arrays/objects outside its strings, found
    before ``json.loads`` builds them: a cheap upper bound first, then the exact count (escapes dropped
    pair by pair, the text split at its quotes), each step one short C call."""
    if raw.count(b"{") + raw.count(b"[") <= cap:
        return False
    outside = raw.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2]
    n = 0
    for part in outside:
        n += part.count(b"{") + part.count(b"[")
        if n > cap:
            return True
    return False


def loads_untrusted(raw: bytes | str, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH,
                    max_containers: int | None = None) -> Any:
    """Parse JSON that crossed a trust boundary, refusing what could hurt a reader later.

    The one parser for lane entries, bulk input lines and anything else a stranger can
    write: at most ``max_bytes`` (UTF-8), at most ``max_depth`` levels of arrays/objects,
    valid UTF-8 with no lone surrogates (``"\\ud800"`` parses in Python but can never be
    written back as UTF-8, so it would break whoever serializes the result), and no
    NaN/Infinity; with ``max_containers``, at most that many arrays and objects, counted before they
    are built. Raises ``UntrustedJSONError`` saying which rule was broken.
    """
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise UntrustedJSONError(f"payload is {size} bytes; at most {max_bytes} are accepted")
    if max_containers is not None and count_containers_past(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass"), max_containers):
        raise UntrustedJSONError(f"more than {max_containers} arrays and objects")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UntrustedJSONError(f"payload is not valid UTF-8: {exc}") from None
    try:
        value = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise UntrustedJSONError(f"JSON nested deeper than {max_depth} levels") from None
    except UntrustedJSONError:
        raise
    except ValueError as exc:  # JSONDecodeError, and int() refusing a number of more than 4,300 digits
        raise UntrustedJSONError(f"not valid JSON: {exc}") from None
    check_json_tree(value, max_depth)
    return value


def check_json_tree(value: Any, max_depth: int) -> None:
    """Raise ``UntrustedJSONError`` if ``value`` nests deeper than ``max_depth`` or holds a lone surrogate."""
    stack = [(value, 0)]  # iterative: a deep tree must not recurse here either
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v)
        elif isinstance(v, (list, dict)):
            if depth >= max_depth:
                raise UntrustedJSONError(f"JSON nested deeper than {max_depth} levels")
            if isinstance(v, dict):
                for k, item in v.items():
                    _check_text(k)
                    stack.append((item, depth + 1))
            else:
                # A job's token ids are a list of hundreds of ints: scalars are checked in place
                # (strings) or skipped, and only containers go on the stack.
                for item in v:
                    t = type(item)
                    if t is int or t is float or t is bool or item is None:
                        continue
                    if t is str:
                        _check_text(item)
                    else:
                        stack.append((item, depth + 1))


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise UntrustedJSONError(f"string holds a lone surrogate (not encodable as UTF-8): {s[:40]!r}") from None
