"""Structured outputs in the queue's contract (issue 23): ``structured_outputs`` and OpenAI's
``response_format`` on a job, checked at submit (a bad schema or regex is a ValueError at the
producer and never reaches the lane stream), carried over the wire unchanged, and read by the
engine's SamplingParams as the same constraint."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.schema import JobRequest, SamplingOptions
from pagestream.producer.protocol.structured import GUIDED_REPLACEMENTS, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "pop": {"type": "integer", "minimum": 0}},
          "required": ["city"]}


def _on_the_wire(job: JobRequest) -> JobRequest:
    return JobRequest.model_validate_json(job.model_dump_json(exclude_none=True))


@pytest.mark.parametrize("fields, wire", [
    ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
     {"json": SCHEMA, "disable_any_whitespace": True}),
    ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, {"regex": r"\d{3}-\d{4}"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"grammar": 'root ::= "a"+'}}, {"grammar": 'root ::= "a"+'}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA, "disable_additional_properties": True}),
    ({"sampling": {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}},
     {"json": SCHEMA}),
])
def test_a_constraint_travels_the_wire_and_reaches_the_engine_as_sent(fields, wire):
    job = _on_the_wire(JobRequest(prompt="hi", **fields))
    assert json.loads(job.model_dump_json())["sampling"]["structured_outputs"] == wire
    pytest.importorskip("torch")
    from pagestream.engine import SamplingParams, StructuredOutputsParams

    params = SamplingParams(**job.sampling.engine_kwargs())
    assert params.structured_outputs == StructuredOutputsParams(**wire)


def test_text_response_format_is_no_constraint():
    job = _on_the_wire(JobRequest(prompt="hi", response_format={"type": "text"}))
    assert job.sampling.structured_outputs is None
    assert "response_format" not in job.model_dump_json()


@pytest.mark.parametrize("fields, reason", [
    ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json is not a valid JSON schema"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"minimum": "zero"}}}}},
     "'zero' is not of type 'number' (at properties/a/minimum)"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json is not valid JSON"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex is not a valid regular expression"),
    ({"structured_outputs": {"choice": []}}, "at least one string"),
    ({"structured_outputs": {}}, "exactly one of json, json_object, regex, choice, grammar; got none"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "got ['regex', 'choice']"),
    ({"structured_outputs": {"guided_json": SCHEMA}}, "guided_json"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema is missing"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
])
def test_submit_refuses_a_bad_constraint_before_redis(producer, r, fields, reason):
    with pytest.raises(ValueError) as exc:
        producer.submit(prompt="hi", **fields)
    assert reason in str(exc.value)
    assert all(r.xlen(keys.jobs_stream(lane)) == 0 for lane in keys.LANES)


def test_a_good_constraint_is_queued(producer, r):
    job_id = producer.submit(prompt="hi", structured_outputs={"choice": ["yes", "no"]})
    entry = r.xrange(keys.jobs_stream("normal"), count=1)[0][1]
    job = json.loads(entry[b"job"])
    assert job["job_id"] == job_id and job["sampling"]["structured_outputs"] == {"choice": ["yes", "no"]}


def test_spec_size_and_depth_are_bounded(monkeypatch):
    from pagestream.producer.protocol.limits import job_limits

    monkeypatch.setenv("PAGESTREAM_MAX_STRUCTURED_OUTPUT_BYTES", "1024")
    job_limits.cache_clear()
    try:
        with pytest.raises(ValueError, match="PAGESTREAM_MAX_STRUCTURED_OUTPUT_BYTES"):
            JobRequest(prompt="hi", structured_outputs={"choice": ["x" * 600, "y" * 600]})
    finally:
        monkeypatch.delenv("PAGESTREAM_MAX_STRUCTURED_OUTPUT_BYTES")
        job_limits.cache_clear()
    deep: dict = {"type": "object"}
    for _ in range(30):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValueError, match="at most 24 levels"):
        StructuredOutputs(json=deep)


def test_every_removed_guided_field_names_its_replacement():
    assert set(GUIDED_REPLACEMENTS) >= {"guided_json", "guided_regex", "guided_choice", "guided_grammar"}
    assert all("structured_outputs" in v or "nothing" in v for v in GUIDED_REPLACEMENTS.values())


@pytest.mark.parametrize("body, loc", [
    # the property suite's case (issue 36): the error named `json_schema`, a field the client never sent
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
     ("response_format", "json_schema", "schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, ("response_format", "json_schema")),
    ({"response_format": {"type": "xml"}}, ("response_format", "type")),
    ({"structured_outputs": {"json": {"type": 7}}}, ("structured_outputs", "json")),
])
def test_a_nested_error_names_the_path_the_client_sent(body, loc):
    """As sampling options, and as a job, where flat sampling fields are under ``sampling``
    (the gateway's ``param`` drops that prefix: tests/test_structured_gateway.py)."""
    for model, where in ((SamplingOptions, loc), (JobRequest, ("sampling", *loc))):
        with pytest.raises(ValidationError) as info:
            model.model_validate({"prompt": "hi", **body} if model is JobRequest else body)
        (error,) = info.value.errors()
        assert error["loc"] == where, error
        assert ".".join(loc) in error["msg"], error["msg"]
