"""A chat request's tools as the job carries them (issue 26), without services: the tools for the template,
the constraint ``required`` and a named tool become (vLLM's schema), the conversation's calls with their
arguments as objects, and the checks that answer 400."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pagestream.producer.gateway.protocol import ChatCompletionRequest
from pagestream.producer.protocol.errors import RequestError
from pagestream.producer.protocol.schema import JobRequest

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
ASK = [{"role": "user", "content": "weather?"}]


def _job(**body) -> JobRequest:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **body})
    (job,) = req.to_jobs(["j1"])
    return JobRequest.model_validate_json(job.model_dump_json(exclude_none=True))  # as it comes off the lane


def test_tools_travel_to_the_template_and_none_or_auto_leave_the_output_free():
    for choice in ("none", "auto", None):
        job = _job(tools=TOOLS, **({"tool_choice": choice} if choice else {}))
        assert job.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                             {"type": "function", "function": {"name": "ping"}}]
        assert job.sampling.structured_outputs is None


def test_named_is_held_to_the_tools_parameters():
    job = _job(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert job.sampling.structured_outputs.json_schema == WEATHER
    job = _job(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}})
    assert job.sampling.structured_outputs.json_schema == {"type": "object", "properties": {}}


def test_required_is_held_to_an_array_of_calls_of_the_given_tools():
    schema = _job(tools=TOOLS, tool_choice="required").sampling.structured_outputs.json_schema
    ok = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
                [{"name": "get_weather"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = _job(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).sampling.structured_outputs.json_schema
    assert one["maxItems"] == 1


def test_an_assistants_calls_and_the_tool_answer_reach_the_job():
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "22 C"}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": turn, "tools": TOOLS, "tool_choice": "none"})
    (job,) = req.to_jobs(["j1"])
    msgs = [m.model_dump(exclude_none=True) for m in job.messages]
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert msgs[2] == {"role": "tool", "content": "22 C", "tool_call_id": "chatcmpl-tool-1"}
    json.dumps(msgs)


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "does not match"),
    ({"tools": TOOLS + TOOLS[:1]}, "distinct function names"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"json_object": True}}, "constrains the output"),
])
def test_what_a_request_cannot_ask(body, message):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **body})
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace("`", ".")):
        req.to_jobs(["j1"])


def test_a_bad_tool_schema_is_refused_by_the_request_model():
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]})


def test_tools_need_a_chat_job():
    with pytest.raises(ValueError, match="tools need messages"):
        JobRequest(prompt="x", tools=[TOOLS[0]])


def test_a_batch_line_with_tools_is_an_error_line_not_a_line_without_its_tools():
    from pagestream.producer.bulk.io import BadLine, parse_line

    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": ASK, "tools": TOOLS}})
    bad = parse_line(line, 1)
    assert isinstance(bad, BadLine) and "tools in batch lines is not supported yet" in bad.reason, bad
