"""Tools in chat requests as OpenAI sends them, checked at the producer, and what ``tool_choice`` means.

``tools`` travel on the job to the worker's chat template (its own tool format). ``tool_choice``
``required`` and a named function become a JSON-schema constraint on the output (the structured-outputs
path, built as vLLM builds it), so the answer is always a call of a tool the request gave, with
arguments that validate; ``auto`` leaves the output free and a parser reads the calls out of it
(``producer.protocol.tool_parsers``); ``none`` never answers calls (the tools are still rendered, as vLLM
does by default).

``ToolAnswer`` is what turns a finished job's text into OpenAI's ``message.tool_calls``: the gateway's
chat completions and a bulk's output lines (the worker's bulk sink, from the job's metadata) answer with
the same code, so a Batch API line with tools gets the gateway's answer.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagestream.producer.protocol.errors import RequestError
from pagestream.producer.protocol.structured import MAX_SCHEMA_DEPTH, check_json_schema
from pagestream.producer.protocol.tool_parsers import TOOL_PARSERS, NamedToolParser, RequiredToolParser, ToolParser
from pagestream.producer.protocol.untrusted import UntrustedJSONError, check_json_tree

#: OpenAI's rule for a function's name
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
#: vLLM's answer to ``auto`` on a server started without a parser
AUTO_NEEDS_PARSER = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def no_tool_format(model: str | None) -> str:
    """The refusal of tools for a model whose workers announce a chat template that never reads ``tools``."""
    return (f"the chat template of model '{model}' has no tool format (it never reads `tools`), "
            "so it cannot be given tools; serve a model whose template has one")


#: tools one chat request may carry (OpenAI's own limit)
MAX_TOOLS = 128


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"function name {v[:80]!r} must be 1-64 of a-z, A-Z, 0-9, '_', '.', '-'")
        return v

    @field_validator("parameters", mode="before")
    @classmethod
    def _parameters(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, (dict, list)):
            try:
                check_json_tree(v, MAX_SCHEMA_DEPTH)
            except UntrustedJSONError as exc:
                raise ValueError(f"parameters: {exc} (at most {MAX_SCHEMA_DEPTH} levels)") from None
        check_json_schema(v, "parameters")
        return v


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        """The tool as chat templates read it (vLLM passes OpenAI's object as it came)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}

    @property
    def parameters(self) -> dict[str, Any]:
        return self.function.parameters or EMPTY_PARAMETERS


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolUse(BaseModel):
    """A request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, resolved: ``choice`` is ``none``,
    ``auto``, ``required`` or the named tool's name in ``named``."""

    tools: list[ChatTool] = Field(default_factory=list)
    choice: Literal["none", "auto", "required", "named"] = "none"
    named: str | None = None
    parallel_tool_calls: bool = True

    @classmethod
    def resolve(cls, tools: list[ChatTool] | None, tool_choice: ToolChoice | None,
                parallel_tool_calls: bool | None) -> ToolUse:
        """As vLLM reads them: ``tool_choice`` defaults to ``auto`` with tools, ``none`` without; a choice
        other than ``none`` needs tools, and a named one a tool of that name (``RequestError`` otherwise)."""
        parallel = True if parallel_tool_calls is None else parallel_tool_calls
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        if not tools:
            if tool_choice != "none":
                raise RequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
            return cls(parallel_tool_calls=parallel)
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise RequestError(f"tools must have distinct function names, got {names}", param="tools")
        if isinstance(tool_choice, NamedToolChoice):
            if tool_choice.function.name not in names:
                raise RequestError("The tool specified in `tool_choice` does not match any of the specified `tools`: "
                                   f"{tool_choice.function.name!r} is not one of {names}", param="tool_choice")
            return cls(tools=tools, choice="named", named=tool_choice.function.name, parallel_tool_calls=parallel)
        return cls(tools=tools, choice=tool_choice, parallel_tool_calls=parallel)

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def answering(self, parser: str | None) -> ToolAnswer | None:
        """How the job's text is read back as calls (None for ``none``: text only); ``parser`` is the server's
        ``--tool-call-parser``, which only ``auto`` reads (``RequestError`` with vLLM's message without one)."""
        if not self.active:
            return None
        if self.choice == "auto" and not parser:
            raise RequestError(AUTO_NEEDS_PARSER, param="tool_choice")
        return ToolAnswer(choice=self.choice, named=self.named, parallel_tool_calls=self.parallel_tool_calls,
                          parser=parser if self.choice == "auto" else None)

    def tool(self, name: str) -> ChatTool:
        return next(t for t in self.tools if t.function.name == name)

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output is held to: the named tool's parameters, or for ``required`` an array
        of ``{name, parameters}`` with one ``anyOf`` branch per tool (vLLM's ``get_json_schema_from_tool``;
        ``parallel_tool_calls: false`` caps it at one item)."""
        if self.choice == "named":
            return self.tool(self.named).parameters
        if self.choice != "required":
            return None
        branches = [{"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": t.parameters},
                     "required": ["name", "parameters"]} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        defs = {k: v for t in self.tools for k, v in (t.parameters.get("$defs") or {}).items()}
        if defs:  # "$ref": "#/$defs/..." inside a tool's parameters points at the root once nested
            schema["$defs"] = defs
        return schema

    def job_fields(self, response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None) -> dict[str, Any]:
        """What the job carries for these tools: the template's ``tools`` and, for ``required`` or a named tool,
        the output's constraint (which leaves no room for one the request gave too)."""
        fields: dict[str, Any] = {}
        if self.tools:
            fields["tools"] = [t.for_template() for t in self.tools]
        schema = self.output_schema()
        if schema is not None:
            if structured_outputs is not None or (response_format or {}).get("type", "text") != "text":
                raise RequestError(f"tool_choice {self.choice!r} constrains the output to the tools' schemas; give no "
                                   "response_format or structured_outputs with it", param="tool_choice")
            fields["structured_outputs"] = {"json": schema}
        return fields


class ToolAnswer(BaseModel):
    """What reading a finished job's text as calls needs of its request: the resolved ``tool_choice``, its
    ``parallel_tool_calls`` and, for ``auto``, the parser's name. Small and JSON: a bulk job carries it in its
    metadata to the worker that writes its output line."""

    model_config = ConfigDict(extra="ignore")

    choice: Literal["auto", "required", "named"]
    named: str | None = None
    parallel_tool_calls: bool = True
    parser: str | None = None

    @model_validator(mode="after")
    def _readable(self) -> ToolAnswer:
        if self.choice == "named" and not self.named:
            raise ValueError("a named tool_choice needs the tool's name")
        if self.choice == "auto" and self.parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser {self.parser!r} is not one of {sorted(TOOL_PARSERS)}")
        return self

    def new_parser(self) -> ToolParser:
        if self.choice == "named":
            return NamedToolParser(self.named)
        if self.choice == "required":
            return RequiredToolParser()
        return TOOL_PARSERS[self.parser]()

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """``tool_calls`` when ``auto`` answered calls or ``required`` stopped on its own; a named tool keeps
        ``stop``, as vLLM answers (None: the engine's reason stands)."""
        if called and (self.choice == "auto" or (self.choice == "required" and reason == "stop")):
            return "tool_calls"
        return None

    def answer(self, body: dict[str, Any], texts: dict[int, str]) -> None:
        """A ``chat.completion`` body's choices as calls (``content`` null unless the model wrote text before them)."""
        for choice in body["choices"]:
            text = texts.get(choice["index"], "")
            extracted = self.new_parser().extract(text)
            calls = extracted.tool_calls if self.parallel_tool_calls else extracted.tool_calls[:1]
            if not calls:
                continue  # auto answered text
            choice["message"]["content"] = extracted.content
            choice["message"]["tool_calls"] = [c.to_openai() for c in calls]
            choice["finish_reason"] = self.finish_reason(True, choice["finish_reason"]) or choice["finish_reason"]


def arguments_as_object(arguments: Any) -> Any:
    """An assistant message's call arguments for the chat template: OpenAI sends JSON text, templates
    render an object (``| tojson``), so text that parses is handed over parsed, as vLLM does."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
