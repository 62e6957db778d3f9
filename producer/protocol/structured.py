"""A job's structured-output constraint as the queue carries it, checked at submit.

Mirrors ``engine.structured_output.StructuredOutputsParams`` (vLLM's field names) and takes
OpenAI's ``response_format`` too. What can be checked without the engine is checked here,
so a bad request is a ``ValueError`` at the producer and never reaches a worker: a JSON
schema against its meta-schema (``jsonschema``), a regex with Python's ``re`` (a pre-check:
the worker's compiler refuses a few constructs ``re`` takes, such as lookaround, and that
ends the job as failed with the compiler's message), the size of the spec. Grammar syntax
is the worker's compiler's to check.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from pagestream.producer.protocol.grammar_check import check_spec
from pagestream.producer.protocol.limits import job_limits
from pagestream.producer.protocol.untrusted import UntrustedJSONError, check_json_tree

KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: nesting of a JSON schema (the job around it adds ~4 levels to the lane entry's 32)
MAX_SCHEMA_DEPTH = 24
#: vLLM's removed request fields, and what replaces each
GUIDED_REPLACEMENTS = {
    "guided_json": "structured_outputs.json (or response_format json_schema)",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_json_object": "structured_outputs.json_object (or response_format json_object)",
    "guided_decoding_backend": "nothing (pagestream compiles with xgrammar)",
    "guided_whitespace_pattern": "structured_outputs.disable_any_whitespace",
}


def removed_guided(get: Callable[[str], Any]) -> tuple[str, str] | None:
    """The first of vLLM's removed ``guided_*`` fields that ``get(name)`` finds set: its name and the
    message that names its replacement (the gateway's 400 and a batch line's error say the same)."""
    for name, replacement in GUIDED_REPLACEMENTS.items():
        if get(name) is not None:
            return name, f"{name} was removed (as in vLLM); use {replacement}"
    return None


def check_json_schema(schema: Any, where: str) -> None:
    """ValueError unless ``schema`` is a JSON schema its meta-schema accepts (when jsonschema is installed)."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{where} must be a JSON schema (an object), got {type(schema).__name__}")
    try:
        import jsonschema
    except ImportError:  # a producer-only install without it: the worker's compiler still checks
        return
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ValueError(f"{where} is not a valid JSON schema: {exc.message} (at {path})") from None


def checked_schema(v: Any, where: str) -> Any:
    """A schema given as a dict or as JSON text, bounded in depth and checked by its meta-schema;
    ``where`` is the field's path from the top of the body, for the error."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if isinstance(v, (dict, list)):
        try:
            check_json_tree(v, MAX_SCHEMA_DEPTH)
        except UntrustedJSONError as exc:
            raise ValueError(f"{where}: {exc} (at most {MAX_SCHEMA_DEPTH} levels)") from None
    if v is not None:
        check_json_schema(v, where)
        check_spec("json", v, where)
    return v


class StructuredOutputs(BaseModel):
    """Exactly one of ``json`` (a schema, dict or JSON text), ``json_object``, ``regex``,
    ``choice``, ``grammar`` (EBNF or Lark); whitespace options as vLLM's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    json_schema: dict[str, Any] | bool | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema(cls, v: Any) -> Any:
        return checked_schema(v, "structured_outputs.json")

    @field_validator("regex")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            if not v:
                raise ValueError("structured_outputs.regex must not be empty")
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"structured_outputs.regex is not a valid regular expression: {exc}") from None
            check_spec("regex", v, "structured_outputs.regex")
        return v

    @field_validator("choice")
    @classmethod
    def _choice(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("structured_outputs.choice must hold at least one string")
        check_spec("choice", v, "structured_outputs.choice")
        return v

    @field_validator("grammar")
    @classmethod
    def _grammar(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("structured_outputs.grammar must not be empty")
        check_spec("grammar", v, "structured_outputs.grammar")
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputs:
        given = [k for k in KINDS if self._value(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object takes true (any JSON object)")
        size = len(json.dumps(self.model_dump(), ensure_ascii=False).encode("utf-8"))
        limit = job_limits().max_structured_output_bytes
        if size > limit:
            raise ValueError(f"structured_outputs is {size} bytes as JSON; at most {limit} bytes allowed "
                             "(PAGESTREAM_MAX_STRUCTURED_OUTPUT_BYTES)")
        return self

    def _value(self, kind: str) -> Any:
        return self.json_schema if kind == "json" else getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._value(k) not in (None, False))

    @model_serializer(mode="plain")
    def _to_wire(self) -> dict[str, Any]:
        # the engine's (and vLLM's) field names, only what is set
        out: dict[str, Any] = {self.kind: self._value(self.kind)}
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        if self.disable_additional_properties:
            out["disable_additional_properties"] = True
        return out


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's ``{name, description, schema, strict}``."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    name: str | None = Field(None, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_", mode="before")
    @classmethod
    def _schema(cls, v: Any) -> Any:
        return checked_schema(v, "response_format.json_schema.schema")

    @model_validator(mode="after")
    def _schema_given(self) -> JsonSchemaFormat:
        if self.schema_ is None:
            raise ValueError("response_format.json_schema.schema is missing")
        return self


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``, typed so that an error's location is the path the client sent
    (``response_format.json_schema.schema``), as OpenAI's and vLLM's 400s name it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, v: Any) -> Any:
        if v not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format.type must be text, json_object or json_schema, got {v!r}")
        return v

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema: {name, schema, strict}")
        return self


def from_response_format(response_format: ResponseFormat | dict[str, Any] | None) -> StructuredOutputs | None:
    """OpenAI's ``response_format`` as a constraint: ``text`` is none, ``json_object`` any JSON
    object, ``json_schema`` its ``schema`` (``name`` and ``strict`` are OpenAI's labels; with
    ``strict`` objects that do not say otherwise take no additional properties)."""
    if response_format is None:
        return None
    if not isinstance(response_format, ResponseFormat):
        response_format = ResponseFormat.model_validate(response_format)
    if response_format.type == "json_object":
        return StructuredOutputs(json_object=True)
    if response_format.type == "json_schema":
        spec = response_format.json_schema
        return StructuredOutputs(json_schema=spec.schema_, disable_additional_properties=bool(spec.strict))
    return None
