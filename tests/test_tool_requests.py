"""A chat request's tools as the job carries them (issue 26), without services: the tools for the template,
the constraint ``required`` and a named tool become (vLLM's schema), the conversation's calls with their
arguments as objects, and the checks that answer 400."""
from __future__ import annotations

import json

import jsonschema
import pytest
import redis

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


def _batch_job(body: dict, parser: str | None = None, plain: bool = False):
    """A Batch API line (or a plain line) through the bulk path: parsed, then the job's fields (or its BadLine)."""
    from pagestream.producer.bulk.io import BadLine, parse_line
    from pagestream.producer.bulk.orchestrator import bulk_job
    from pagestream.producer.protocol.bulk import BulkSpec

    line = {"custom_id": "a", **body} if plain else \
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    req = parse_line(json.dumps(line), 7)
    if isinstance(req, BadLine):
        return req
    fields = bulk_job(req, BulkSpec(bulk_id="b1", input="/in.jsonl", output="/out", tool_call_parser=parser))
    return fields if isinstance(fields, BadLine) else JobRequest.model_validate_json(JobRequest(**fields).model_dump_json())


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["required", NAMED, "none"])
@pytest.mark.parametrize("plain", [False, True])
def test_a_batch_line_with_tools_becomes_the_gateways_job(choice, plain):
    """The same tools for the template and the same constraint as the gateway's job for the same body, and
    how the output line reads the calls back (in the job's metadata, for the worker that writes it)."""
    from pagestream.producer.bulk.parts import TOOL_ANSWER

    body = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
    job, want = _batch_job(body, plain=plain), _job(**{k: v for k, v in body.items() if k not in ("model", "messages")})
    assert job.tools == want.tools and job.tools[0]["function"]["parameters"] == WEATHER
    assert job.sampling.structured_outputs == want.sampling.structured_outputs
    if choice == "none":
        assert job.sampling.structured_outputs is None and TOOL_ANSWER not in job.metadata
        return
    assert job.sampling.structured_outputs is not None
    assert job.metadata[TOOL_ANSWER] == ({"choice": "required", "parallel_tool_calls": False} if choice == "required"
                                         else {"choice": "named", "named": "get_weather", "parallel_tool_calls": False})


def test_an_auto_batch_line_needs_the_bulks_tool_call_parser():
    """As vLLM's run-batch without --enable-auto-tool-choice --tool-call-parser: an error line with the
    server's message, never a line answered as text; with the bulk's parser, a free output read by it."""
    from pagestream.producer.bulk.io import BadLine
    from pagestream.producer.bulk.parts import TOOL_ANSWER
    from pagestream.producer.protocol.bulk import BulkSpec
    from pagestream.producer.protocol.tools import AUTO_NEEDS_PARSER

    for choice in ({"tool_choice": "auto"}, {}):  # auto is the default with tools
        bad = _batch_job({"model": "m", "messages": ASK, "tools": TOOLS, **choice})
        assert isinstance(bad, BadLine) and bad.reason == AUTO_NEEDS_PARSER and bad.custom_id == "a" and bad.line == 7
    job = _batch_job({"model": "m", "messages": ASK, "tools": TOOLS}, parser="hermes")
    assert job.tools and job.sampling.structured_outputs is None
    assert job.metadata[TOOL_ANSWER] == {"choice": "auto", "parallel_tool_calls": True, "parser": "hermes"}
    with pytest.raises(ValueError, match="not one of"):
        BulkSpec(bulk_id="b1", input="/in", output="/out", tool_call_parser="no-such-parser")


@pytest.mark.parametrize(("body", "message"), [
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "does not match"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "distinct function names"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "constrains the output"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}, "function name"),
    ({"tools": TOOLS * 65, "tool_choice": "required"}, "at most 128"),
])
def test_bad_tools_in_a_batch_line_are_the_gateways_400_as_an_error_line(body, message):
    from pagestream.producer.bulk.io import BadLine

    bad = _batch_job({"model": "m", "messages": ASK, **body})
    assert isinstance(bad, BadLine) and message in bad.reason and bad.custom_id == "a", bad


def _sink_line(body: dict, text: str, parser: str | None = None, **metadata) -> dict:
    """The output record the worker's bulk sink writes for the bulk job of ``body`` that answered ``text``."""
    from pagestream.producer.protocol.schema import JobResult, JobStatus, SampleResult
    from pagestream.worker.bulk_sink import BulkSink

    job = _batch_job(body, parser=parser)
    job.metadata.update(metadata)
    sink = BulkSink(redis.Redis(), "w1")  # add() only buffers: no Redis call
    sink.add("low", "1-0", job, JobResult(job_id=job.job_id, status=JobStatus.COMPLETED, text=text, model="m",
                                          outputs=[SampleResult(index=0, text=text, token_ids=[1, 2], finish_reason="stop")],
                                          finish_reason="stop"))
    ((_, _, entry),) = sink._buffers["b1"].items
    return entry.record


def _gateway_message(body: dict, text: str, parser: str | None = None) -> dict:
    """The gateway's chat.completion message for ``body`` when its job answered ``text``."""
    from pagestream.producer.gateway.chat.tools import answer_calls
    from pagestream.producer.gateway.settings import GatewaySettings
    from pagestream.producer.protocol.openai import chat_completion_body
    from pagestream.producer.protocol.schema import JobResult, JobStatus, SampleResult

    req = ChatCompletionRequest.model_validate(body)
    result = JobResult(job_id="j", status=JobStatus.COMPLETED, text=text, finish_reason="stop",
                       outputs=[SampleResult(index=0, text=text, token_ids=[1, 2], finish_reason="stop")])
    out = chat_completion_body("chatcmpl-j", "m", 0, result)
    settings = GatewaySettings(enable_auto_tool_choice=parser is not None, tool_call_parser=parser)
    answer_calls(out, {0: text}, req.tool_use(), settings)
    return out["choices"][0]


def _without_ids(choice: dict) -> dict:
    calls = choice["message"].get("tool_calls")
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls or ())
    return {**choice, "message": {**choice["message"], "tool_calls": [{k: v for k, v in c.items() if k != "id"}
                                                                      for c in calls] if calls else calls}}


@pytest.mark.parametrize(("choice", "parser", "text", "reason"), [
    (NAMED, None, '{"city": "Paris"}', "stop"),
    ("required", None, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "ping", "parameters": {}}]',
     "tool_calls"),
    ("auto", "hermes", 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "tool_calls"),
    ("auto", "hermes", "It is sunny.", "stop"),
])
def test_a_batch_output_line_answers_the_calls_the_gateway_answers(choice, parser, text, reason):
    body = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": choice}
    record = _sink_line(body, text, parser=parser)
    assert record["error"] is None and record["response"]["status_code"] == 200
    (got,) = record["response"]["body"]["choices"]
    assert _without_ids(got) == _without_ids(_gateway_message(body, text, parser))
    assert got["finish_reason"] == reason
    if reason == "tool_calls" or choice == NAMED:
        calls = got["message"]["tool_calls"]
        assert calls and all(c["type"] == "function" for c in calls)
        assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Oslo")
    else:
        assert got["message"]["content"] == text and "tool_calls" not in got["message"]


def test_a_tool_answer_the_worker_cannot_read_is_an_error_line_not_text():
    from pagestream.producer.bulk.parts import TOOL_ANSWER

    body = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": "auto"}
    record = _sink_line(body, "hi", parser="hermes", **{TOOL_ANSWER: {"choice": "auto", "parser": "from-the-future"}})
    assert record["response"] is None and "tool_call_parser 'from-the-future'" in record["error"]["message"]
