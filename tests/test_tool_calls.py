"""Tools in chat completions (issue 26, acceptance 1) with the official openai client against a gateway and
SmolLM2-135M workers on the CPU.

SmolLM2's own template has no tool format (it renders role and content only, so ``tools`` would be
dropped): the model served with tools here is SmolLM2's weights and tokenizer with a Qwen2.5-style
template (``qwen2_tool_template.jinja``: tools in the system turn, ``<tool_call>`` blocks, ``tool``
messages as ``<tool_response>``); stock SmolLM2 is served beside it for the "no tool format" 400.
The parsers themselves are tested on recorded outputs in test_tool_parsers.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import redis

from gateway_helpers import DB_URL, GatewayProc
from pagestream.producer import Producer
from queue_helpers import WorkerProc, wait_for

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

TOOLS_MODEL, PLAIN_MODEL = "smol-tools", "smol-plain"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 16}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def _tools_model(base: str, out: Path) -> Path:
    """SmolLM2 with a template that has a tool format (weights linked, not copied)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(base).iterdir():
        if f.name != "chat_template.jinja":
            (out / f.name).symlink_to(f)
    (out / "chat_template.jinja").write_text((Path(__file__).parent / "qwen2_tool_template.jinja").read_text())
    return out


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    log_dir = tmp_path_factory.mktemp("tool-calls")
    model_dir = _tools_model(smollm2_dir, log_dir / "smollm2-tools")
    args = ("--max-num-seqs", "10", "--max-model-len", "2048")  # the tool loop runs 10 conversations at once
    workers = [WorkerProc(DB_URL, str(model_dir), "tools-worker", "--served-model-name", TOOLS_MODEL, *args, log_dir=log_dir),
               WorkerProc(DB_URL, str(smollm2_dir), "plain-worker", "--served-model-name", PLAIN_MODEL, *args, log_dir=log_dir)]
    gw = GatewayProc(DB_URL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", log_dir=log_dir)
    bare = GatewayProc(DB_URL, log_dir=log_dir)  # no parser: auto is a 400
    try:
        for w in workers:
            w.wait_ready(300)
        gw.wait_ready()
        bare.wait_ready()
        wait_for(lambda: {TOOLS_MODEL, PLAIN_MODEL} <= set(Producer(r).live_models()), 60, "the workers' announcements")
        yield {"client": _client(gw), "bare": _client(bare), "r": r, "base_url": gw.base_url, "log_dir": log_dir}
    finally:
        gw.stop()
        bare.stop()
        for w in workers:
            w.stop()
        r.flushdb()
        r.close()


def _client(gw: GatewayProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=300)


def _check_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _stream(client, **kwargs):
    """A stream's deltas added up as the openai docs do: content, calls by index, finish_reason."""
    content, calls, reasons, ids = "", {}, [], {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or ():
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name  # id, type and name come first
                    ids[tc.index] = tc.id
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, [(ids[i], calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], reasons


class _Call:  # a streamed call, shaped as the SDK's for _check_calls
    def __init__(self, id, name, arguments):
        self.id, self.type = id, "function"
        self.function = type("F", (), {"name": name, "arguments": arguments})


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_tool_choice_answers_a_call_of_that_tool(stack):
    c = stack["client"]
    resp = c.chat.completions.create(model=TOOLS_MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=80,
                                     temperature=0)
    choice = resp.choices[0]
    _check_calls(choice.message.tool_calls, ["get_weather"])
    assert len(choice.message.tool_calls) == 1 and choice.message.content is None
    assert choice.finish_reason == "stop"  # vLLM's answer for a named tool
    content, calls, reasons = _stream(c, model=TOOLS_MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=80,
                                      temperature=0)
    assert content == "" and reasons == ["stop"]
    _check_calls([_Call(*calls[0])], ["get_weather"])
    assert calls[0][2] == choice.message.tool_calls[0].function.arguments  # greedy: the same call, streamed


def test_required_answers_calls_of_the_given_tools(stack):
    c = stack["client"]
    kwargs = dict(model=TOOLS_MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160, temperature=0)
    resp = c.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    _check_calls(choice.message.tool_calls)
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    content, calls, reasons = _stream(c, **kwargs)
    assert content == "" and reasons == ["tool_calls"]
    _check_calls([_Call(*call) for call in calls])
    assert [(n, a) for _, n, a in calls] == [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    one = c.chat.completions.create(**{**kwargs, "parallel_tool_calls": False})
    assert len(one.choices[0].message.tool_calls) == 1
    _check_calls(one.choices[0].message.tool_calls)


def test_auto_reads_the_models_hermes_calls(stack):
    """The model's own output through the hermes parser: held to a recorded Qwen-style call by a regex, so the
    parse is known; streamed and not."""
    c = stack["client"]
    forced = {"structured_outputs": {"regex": HERMES_CALL.replace("{", "\\{").replace("}", "\\}")}}
    kwargs = dict(model=TOOLS_MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=64, temperature=0,
                  extra_body=forced)
    resp = c.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    _check_calls(choice.message.tool_calls, ["get_weather"])
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    content, calls, reasons = _stream(c, **kwargs)
    assert content == "" and reasons == ["tool_calls"]
    assert [(n, a) for _, n, a in calls] == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    # no call in the text: it is the answer's content
    text = c.chat.completions.create(**{**kwargs, "extra_body": {"structured_outputs": {"regex": "It is sunny[.]"}}})
    assert text.choices[0].message.content == "It is sunny." and not text.choices[0].message.tool_calls
    assert text.choices[0].finish_reason == "stop"


def test_a_two_turn_conversation_with_a_tool_result(stack):
    c = stack["client"]
    first = c.chat.completions.create(model=TOOLS_MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=80,
                                      temperature=0)
    call = first.choices[0].message.tool_calls[0]
    turn = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 22, "sky": "clear"})}]
    second = c.chat.completions.create(model=TOOLS_MODEL, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=24,
                                       temperature=0)
    answer = second.choices[0]
    assert isinstance(answer.message.content, str) and answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")
    # the call and its result reached the template: the prompt grew by at least their text
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


@pytest.mark.parametrize("kwargs, status, message", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "tool_choice": "required"},
     400, "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!", "parameters": WEATHER}}]}, 400, "function name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
     "does not match any of the specified `tools`"),
    ({"tool_choice": "required"}, 400, "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
     "constrains the output"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
])
def test_bad_tools_are_a_400_that_never_reaches_a_worker(stack, kwargs, status, message):
    r = stack["r"]
    before = len(list(r.scan_iter(match="ps:job:*")))
    with pytest.raises(openai.BadRequestError) as err:
        stack["client"].chat.completions.create(model=TOOLS_MODEL, messages=ASK, max_tokens=4, **kwargs)
    assert message in err.value.message
    assert err.value.body["type"] == "invalid_request_error"
    assert len(list(r.scan_iter(match="ps:job:*"))) == before


def test_auto_without_a_parser_is_vllms_400(stack):
    for kwargs in ({"tool_choice": "auto"}, {}):  # tools without tool_choice mean auto, as in vLLM
        with pytest.raises(openai.BadRequestError) as err:
            stack["bare"].chat.completions.create(model=TOOLS_MODEL, messages=ASK, tools=TOOLS, max_tokens=4, **kwargs)
        assert err.value.body["message"] == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    # required needs no parser
    resp = stack["bare"].chat.completions.create(model=TOOLS_MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                 max_tokens=80, temperature=0)
    _check_calls(resp.choices[0].message.tool_calls, ["get_weather"])


def test_a_model_whose_template_has_no_tool_format_is_a_400(stack):
    with pytest.raises(openai.BadRequestError) as err:
        stack["client"].chat.completions.create(model=PLAIN_MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                max_tokens=4)
    assert "has no tool format" in err.value.message and err.value.body["param"] == "tools"
    # without tools it answers as ever
    assert stack["client"].chat.completions.create(model=PLAIN_MODEL, messages=ASK, max_tokens=4).choices[0].message.content


# LangChain's bind_tools and LiteLLM's tool calling: tests/test_clients_tools.py, against `pagestream serve`


def test_the_agents_style_tool_loop_completes_20_conversations(stack):
    """Acceptance 2: bench/tool_loop.py (the openai client's call, run the local function, answer loop) through
    this gateway and worker, 20 conversations, 10 at a time: every one ends in an answer after its tool result."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tool_loop.py"), "--base-url", stack["base_url"],
                          "--model", TOOLS_MODEL, "-n", "20", "--concurrency", "10", "--max-tokens", "48"],
                         capture_output=True, text=True, timeout=600)
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and line["completed"] == 20 and line["tool_calls"] >= 20, (line, out.stderr[-2000:])


def _sse(resp, stop_after: int | None = None, on_stop=None) -> list[dict]:
    events, current = [], {}
    for line in resp.iter_lines():
        if not line:
            if current:
                events.append(current)
            current = {}
            if stop_after is not None and len(events) == stop_after:
                on_stop()
                break
            continue
        name, _, value = line.partition(":")
        current[name] = value.lstrip(" ")
    return events


def _calls_of(events: list[dict]) -> dict[int, list[str]]:
    calls: dict[int, list[str]] = {}
    for ev in events:
        if ev["data"] == "[DONE]":
            continue
        for choice in json.loads(ev["data"]).get("choices", ()):
            for tc in choice["delta"].get("tool_calls", ()):
                have = calls.setdefault(tc["index"], ["", ""])
                have[0] += tc["function"].get("name", "")
                have[1] += tc["function"].get("arguments", "")
    return calls


def test_a_tool_call_stream_resumed_on_another_gateway_adds_up_to_the_whole_answer(stack):
    """The gateway streaming a required call dies (kill -9) mid-call; the client resumes on another gateway
    with Last-Event-ID and the two parts' deltas add up to the unstreamed calls."""
    body = {"model": TOOLS_MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 160,
            "temperature": 0, "stream": True}
    whole = stack["client"].chat.completions.create(**{**body, "stream": False}).choices[0].message.tool_calls
    doomed = GatewayProc(DB_URL, log_dir=stack["log_dir"])
    doomed.wait_ready()
    with httpx.stream("POST", f"{doomed.base_url}/chat/completions", json=body, timeout=120) as resp:
        before = _sse(resp, stop_after=6, on_stop=doomed.proc.kill)
    doomed.proc.wait(10)
    doomed.stop()
    last_id = before[-1]["id"]
    with httpx.stream("GET", f"{stack['base_url']}/streams/{last_id.split(':')[0]}", headers={"Last-Event-ID": last_id},
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        after = _sse(resp)
    assert after[-1]["data"] == "[DONE]"
    first, rest = _calls_of(before), _calls_of(after)
    assert first and rest, (before, after)  # cut mid-call
    got = {i: [first.get(i, ["", ""])[k] + rest.get(i, ["", ""])[k] for k in (0, 1)] for i in {*first, *rest}}
    assert [tuple(got[i]) for i in sorted(got)] == [(t.function.name, t.function.arguments) for t in whole]


def test_tokenize_renders_the_tools_as_a_chat_request_does(stack):
    base = stack["base_url"].removesuffix("/v1")
    plain = httpx.post(f"{base}/tokenize", json={"model": TOOLS_MODEL, "messages": ASK}, timeout=30).json()
    with_tools = httpx.post(f"{base}/tokenize", json={"model": TOOLS_MODEL, "messages": ASK, "tools": TOOLS},
                            timeout=30).json()
    resp = stack["client"].chat.completions.create(model=TOOLS_MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                   max_tokens=80, temperature=0)
    assert with_tools["count"] == resp.usage.prompt_tokens > plain["count"] + 50
