"""What a request constrains its output to: one JSON schema, any JSON object, a regex, a
choice of strings or a grammar, spelled as vLLM's ``StructuredOutputsParams``.

Plain Python (no xgrammar, no torch): ``SamplingParams`` holds one, and the producer's
schema mirrors it. Bad input raises ``ValueError`` naming the field and what is allowed;
whether a grammar or regex compiles is the backend's to say (``StructuredOutputError``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: the constraint kinds; exactly one is set
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output text.

    - ``json``: a JSON schema, as a dict or its JSON text
    - ``json_object``: ``True``: any JSON object
    - ``regex``: the whole output matches it
    - ``choice``: the output is exactly one of these strings
    - ``grammar``: EBNF (GBNF, ``root ::= ...``) or Lark (``start: ...``), as xgrammar accepts them

    ``disable_any_whitespace`` makes JSON compact (no free whitespace between tokens: a model
    cannot loop on newlines); ``disable_additional_properties`` adds
    ``"additionalProperties": false`` to every object of the schema that does not say.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            if not given:
                raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; none was given")
            raise ValueError(f"structured_outputs takes one kind of constraint, got {len(given)}: {', '.join(given)}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object takes true (any JSON object)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must hold strings only")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.whitespace_pattern is not None:
            # xgrammar has no whitespace pattern; vLLM honours it on other backends only
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
                             "use disable_any_whitespace=true for compact JSON")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        """From the wire's (or a user's) dict; unknown keys are an error naming the known ones."""
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if v is not None})

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def json_schema(self) -> dict[str, Any] | bool | None:
        """The schema of a ``json`` or ``json_object`` constraint (with additionalProperties applied)."""
        if self.json_object:
            return {"type": "object"}
        if self.json is None:
            return None
        schema = json.loads(self.json) if isinstance(self.json, str) else self.json
        if self.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return schema

    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on, as a hashable cache key: one schema sent by a
        100k-line bulk compiles once however its dict was ordered."""
        if self.kind in ("json", "json_object"):
            spec = json.dumps(self.json_schema(), sort_keys=True, separators=(",", ":"))
        elif self.kind == "choice":
            spec = json.dumps(list(self.choice))
        else:
            spec = getattr(self, self.kind)
        return (self.kind, spec, self.disable_any_whitespace)


def _no_additional_properties(node: Any) -> Any:
    if isinstance(node, list):
        return [_no_additional_properties(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _no_additional_properties(v) for k, v in node.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
