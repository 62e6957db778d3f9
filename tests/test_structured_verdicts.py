"""Issue 37, acceptance 4: the gateway's verdict on a structured spec against the engine's.

Hypothesis draws regexes, grammars, choices and JSON schemas from fragments that include what the
backend refuses (lookarounds, backreferences, rules that are never defined, a missing ``root``,
``$ref``s to nowhere). Each spec goes through the job schema (what the gateway and bulk lines run,
``producer/protocol/grammar_check.py`` included) and through the engine's own compiler
(``XgrammarBackend`` on SmolLM2's tokenizer, what a worker runs). A spec the job schema accepts must
compile on the engine: never a 200 at the gateway and then a failed job (a 500) on the worker. The
converse is allowed one way only: the gateway also refuses a grammar whose language cannot start,
which the engine would compile and run to ``max_tokens``.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pagestream.producer.protocol.schema import JobRequest

REGEX_PARTS = ["a", "b+", "[0-9]{2}", "(?=a)", "(?!b)", "(?<=a)", r"(a)\1", "(a|b)", "(?P<n>x)", r"\d", r"\bw\b",
               "^", "$", ".*", "(?i)a", r"[^\n]", "a{2,}", r"\w+", "(?:x)", "[a-z]*", r"\s", "(?#c)", "x??"]
RULES = ['root ::= "a"', "root ::= a", 'a ::= "x" a | "y"', "b ::= c", 'c ::= [0-9]+', "root ::= root",
         'root ::= "(" root ")" | ""', 'x ::= "q"', "root ::= b", 'root ::= "a" root', 'start: "a"', "start: b"]
SCHEMA_PARTS = [{"type": "string"}, {"type": "integer", "minimum": 3}, {"$ref": "#/$defs/x"}, {"$ref": "#/nope"},
                {"enum": ["a", 1, None]}, {"type": "string", "pattern": "(?=a)b"}, {"type": "string", "pattern": "a+"},
                {"type": "string", "format": "date"}, {"not": {"type": "string"}}, {"allOf": [{"type": "object"}]},
                {"type": "array", "items": {"type": "number"}, "minItems": 1}, {"const": "k"},
                {"type": "object", "properties": {"p": {"type": "boolean"}}, "required": ["p"]}]

regexes = st.lists(st.sampled_from(REGEX_PARTS), min_size=1, max_size=4).map("".join)
grammars = st.lists(st.sampled_from(RULES), min_size=1, max_size=4, unique=True).map("\n".join)
choices = st.lists(st.sampled_from(["a", "b", "", "é", '"q"', "x\\y"]), min_size=1, max_size=3)


@st.composite
def schemas(draw) -> dict:
    part = draw(st.sampled_from(SCHEMA_PARTS))
    schema = {"type": "object", "properties": {"v": part}, "required": ["v"]} if draw(st.booleans()) else dict(part)
    if draw(st.booleans()):
        schema["$defs"] = {"x": draw(st.sampled_from(SCHEMA_PARTS[:2] + [{"$ref": "#/$defs/x"}]))}
    return schema


specs = st.one_of(regexes.map(lambda v: ("regex", v)), grammars.map(lambda v: ("grammar", v)),
                  choices.map(lambda v: ("choice", v)), schemas().map(lambda v: ("json", v)))


@pytest.fixture(scope="module")
def engine_backend(smollm2_dir):
    from transformers import AutoTokenizer

    from pagestream.engine.structured_output.backend_xgrammar import XgrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    vocab = json.loads((__import__("pathlib").Path(smollm2_dir) / "config.json").read_text())["vocab_size"]
    backend = XgrammarBackend(tokenizer, vocab, max_threads=1, cache_size=8)
    yield backend
    backend.shutdown()


def gateway_accepts(kind: str, value) -> bool:
    try:
        JobRequest(prompt="x", structured_outputs={kind: value})
    except ValidationError:
        return False
    return True


def engine_compiles(backend, kind: str, value) -> bool:
    from pagestream.engine.structured_output.backend_xgrammar import StructuredOutputError
    from pagestream.engine.structured_output.params import StructuredOutputsParams

    try:
        params = StructuredOutputsParams.from_dict({kind: value})
        backend.compile(params, timeout_s=30)
    except (StructuredOutputError, ValueError):
        return False
    return True


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=specs)
def test_a_spec_the_gateway_accepts_compiles_on_the_engine(engine_backend, spec):
    kind, value = spec
    accepted = gateway_accepts(kind, value)
    compiled = engine_compiles(engine_backend, kind, value)
    event(f"{kind}: gateway {'accepts' if accepted else 'refuses'}, engine {'compiles' if compiled else 'refuses'}")
    assert compiled or not accepted, f"the gateway accepts {kind} {value!r}, which the engine cannot compile"


def test_the_refusals_the_engine_gives_are_all_found_up_front(engine_backend):
    """The cases the adversarial run found as 500s, each refused by both."""
    for kind, value in [("regex", "(?=a)b"), ("grammar", 'rule ::= "a"'), ("json", {"$ref": "#/nope"})]:
        assert not engine_compiles(engine_backend, kind, value) and not gateway_accepts(kind, value), (kind, value)
    # an empty language: the engine compiles it (and would run to max_tokens); the gateway refuses it
    assert engine_compiles(engine_backend, "grammar", "root ::= root")
    assert not gateway_accepts("grammar", "root ::= root")
