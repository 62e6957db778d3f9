"""How schema objects are laid out in Redis stream entries and hashes.

Token events are written by the worker once per coalesced delta, so they use
compact JSON built with ``json`` rather than pydantic (the hot path).
"""
from __future__ import annotations

import json
from typing import Any

from pagestream.producer.schema import JobRequest, TokenEvent

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


def loads_untrusted(raw: bytes | str, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON that crossed a trust boundary, refusing what could hurt a reader later.

    The one parser for lane entries, bulk input lines and anything else a stranger can
    write: at most ``max_bytes`` (UTF-8), at most ``max_depth`` levels of arrays/objects,
    valid UTF-8 with no lone surrogates (``"\\ud800"`` parses in Python but can never be
    written back as UTF-8, so it would break whoever serializes the result), and no
    NaN/Infinity. Raises ``UntrustedJSONError`` saying which rule was broken.
    """
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise UntrustedJSONError(f"payload is {size} bytes; at most {max_bytes} are accepted")
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
    _check_tree(value, max_depth)
    return value


def _check_tree(value: Any, max_depth: int) -> None:
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
                stack.extend((item, depth + 1) for item in v)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise UntrustedJSONError(f"string holds a lone surrogate (not encodable as UTF-8): {s[:40]!r}") from None


#: field of a lane-stream entry holding the JobRequest JSON
JOB_FIELD = "job"
#: out-stream entry field naming the event type
TYPE_FIELD = "type"
TOKEN_TYPE = "tok"
END_TYPE = "end"


def job_fields(job: JobRequest) -> dict[str, str]:
    return {JOB_FIELD: job.model_dump_json(exclude_none=True)}


def token_event_fields(sample: int, index: int, token_ids: list[int], text: str, finish_reason: str | None) -> dict[str, str]:
    ev: dict[str, Any] = {"s": sample, "i": index, "t": token_ids, "x": text}
    if finish_reason is not None:
        ev["f"] = finish_reason
    return {TYPE_FIELD: TOKEN_TYPE, "ev": json.dumps(ev, ensure_ascii=False, separators=(",", ":"))}


def end_fields(status: str) -> dict[str, str]:
    return {TYPE_FIELD: END_TYPE, "status": status}


def _s(v: bytes | str) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else v


def decode_out_entry(job_id: str, fields: dict) -> TokenEvent | str:
    """A TokenEvent, or the final status (str) for the ``end`` entry."""
    f = {_s(k): v for k, v in fields.items()}
    if _s(f.get(TYPE_FIELD, b"")) == END_TYPE:
        return _s(f.get("status", b""))
    ev = json.loads(_s(f["ev"]))
    return TokenEvent(
        job_id=job_id, sample=ev["s"], index=ev["i"], token_ids=ev["t"], text=ev["x"], finish_reason=ev.get("f")
    )


class EventDeduper:
    """Drops events a subscriber has already seen, by token index per sample.

    A job re-run after a crash may publish an index range twice (a worker that
    was presumed dead and kept going); visible output stays exactly once.
    """

    def __init__(self, from_index: int = 0) -> None:
        self.from_index = from_index
        self.next_index: dict[int, int] = {}
        self.finished: set[int] = set()

    def accept(self, ev: TokenEvent) -> bool:
        nxt = self.next_index.get(ev.sample, self.from_index)
        if ev.sample in self.finished:
            return False
        if ev.token_ids:
            if ev.end_index <= nxt:
                return False
        elif ev.index < nxt and ev.finish_reason is None:
            return False
        self.next_index[ev.sample] = max(nxt, ev.end_index)
        if ev.finish_reason is not None:
            self.finished.add(ev.sample)
        return True
