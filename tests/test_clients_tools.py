"""Issue 26, acceptance 4: LangChain's ``ChatOpenAI.bind_tools(...)`` and LiteLLM's tool calling against
``pagestream serve``.

One module-scoped ``pagestream serve`` on SmolLM2's weights with a Qwen2.5-style tool template
(``qwen2_tool_template.jinja``, as test_tool_calls serves it) and the hermes parser. Each library is driven as
a user drives it: a named tool (and LangChain's ``"any"``, OpenAI's ``required``) answered as a call whose
arguments validate against the tool's schema, whole and streamed (the streamed chunks added up by the library
itself give the same call), then the tool's result sent back and answered in text.

Both libraries are kept off the network and imported at first use (tests/client_libs.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import redis

from client_libs import langchain_messages, langchain_openai, litellm  # imported at first use
from gateway_helpers import DB_URL, ServeProc
from pagestream.producer import Producer
from private_redis import free_port
from queue_helpers import wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:.*ReadOnly:UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

MODEL = "smol-tools"
KEY = "sk-unused"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 16}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def base_url(smollm2_dir, tmp_path_factory):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    log_dir = tmp_path_factory.mktemp("clients-tools")
    model_dir = log_dir / "smollm2-tools"
    model_dir.mkdir()
    for f in Path(smollm2_dir).iterdir():
        if f.name != "chat_template.jinja":
            (model_dir / f.name).symlink_to(f)
    (model_dir / "chat_template.jinja").write_text((Path(__file__).parent / "qwen2_tool_template.jinja").read_text())
    serve = ServeProc(model_dir, "--served-model-name", MODEL, "--max-num-seqs", "4", "--max-model-len", "2048",
                      "--no-bulk-worker", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", log_dir=log_dir,
                      env={"PAGESTREAM_GATEWAY_FILES_URI": str(log_dir / "files"), "PAGESTREAM_METRICS_PORT": str(free_port())})
    try:
        serve.wait_ready()
        wait_for(lambda: MODEL in Producer(r).live_models(), 60, "the model announced")
        yield serve.base_url
    finally:
        serve.stop()
        r.flushdb()
        r.close()


def _valid(name: str, args: dict) -> None:
    assert name in SCHEMAS
    jsonschema.validate(args, SCHEMAS[name])


# -- LangChain ---------------------------------------------------------------------------------------


def _lc(base_url: str, **kw):
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=base_url, api_key=KEY, max_retries=0, timeout=300,
                                       **{"temperature": 0, "max_tokens": 96, **kw})


def test_langchain_bind_tools_named_whole_and_streamed_then_the_tool_result(base_url):
    chat = _lc(base_url).bind_tools(TOOLS, tool_choice="get_weather")
    msg = chat.invoke(ASK)
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"] and call["type"] == "tool_call"
    _valid(call["name"], call["args"])
    assert not msg.invalid_tool_calls
    # streamed: LangChain adds the tool_call_chunks up into the same call
    chunks = list(chat.stream(ASK))
    assert len(chunks) > 2
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    (streamed,) = whole.tool_calls
    assert streamed["name"] == "get_weather" and streamed["args"] == call["args"]
    # the tool's answer goes back as a ToolMessage; the model answers in text
    answer = _lc(base_url, max_tokens=24).bind_tools(TOOLS, tool_choice="none").invoke(
        [langchain_messages.HumanMessage(ASK), msg, langchain_messages.ToolMessage(json.dumps({"temperature": 21, "unit": "celsius"}), tool_call_id=call["id"])])
    assert answer.content.strip() and not answer.tool_calls


def test_langchain_bind_tools_any_answers_calls_of_the_given_tools(base_url):
    msg = _lc(base_url, max_tokens=160).bind_tools(TOOLS, tool_choice="any").invoke(ASK)  # OpenAI's "required"
    assert msg.tool_calls and not msg.invalid_tool_calls
    for call in msg.tool_calls:
        _valid(call["name"], call["args"])
    assert msg.response_metadata["finish_reason"] == "tool_calls"


# -- LiteLLM ----------------------------------------------------------------------------------------


def _litellm(base_url: str, **kw):
    return litellm.completion(model=f"openai/{MODEL}", api_base=base_url, api_key=KEY, num_retries=0,
                              **{"temperature": 0, "max_tokens": 96, **kw})


def test_litellm_tool_calling_named_whole_and_streamed_then_the_tool_result(base_url):
    named = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": ASK}]
    resp = _litellm(base_url, messages=messages, tools=TOOLS, tool_choice=named)
    message = resp.choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.id
    _valid(call.function.name, json.loads(call.function.arguments))
    # streamed: LiteLLM's own stream_chunk_builder puts the deltas back together into the same call
    chunks = list(_litellm(base_url, messages=messages, tools=TOOLS, tool_choice=named, stream=True))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=messages)
    (streamed,) = rebuilt.choices[0].message.tool_calls
    assert streamed.function.name == "get_weather"
    assert json.loads(streamed.function.arguments) == json.loads(call.function.arguments)
    # the tool's result in a ``tool`` message, answered in text
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    answer = _litellm(base_url, messages=follow, tools=TOOLS, tool_choice="none", max_tokens=24)
    assert answer.choices[0].message.content.strip() and not answer.choices[0].message.tool_calls


def test_litellm_required_tool_choice_answers_calls_and_a_bad_tool_choice_is_its_bad_request_error(base_url):
    resp = _litellm(base_url, messages=[{"role": "user", "content": ASK}], tools=TOOLS, tool_choice="required",
                    max_tokens=160)
    calls = resp.choices[0].message.tool_calls
    assert calls and resp.choices[0].finish_reason == "tool_calls"
    for call in calls:
        _valid(call.function.name, json.loads(call.function.arguments))
    with pytest.raises(litellm.BadRequestError) as exc:
        _litellm(base_url, messages=[{"role": "user", "content": ASK}], tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "no_such_tool"}})
    assert "no_such_tool" in str(exc.value)
