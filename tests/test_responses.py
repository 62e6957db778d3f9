"""``/v1/responses`` (issue 26, acceptance 3) with the official openai client against a gateway and workers.

A fake-engine worker (its text a pure function of prompt and seed, its tokenizer whitespace words, so a
prompt's size says exactly which turns reached it) answers the protocol's shape: create whole and streamed
(every event validated with the SDK's own types), retrieve, delete, ``previous_response_id`` over three turns,
tenants, refused fields, and a worker killed mid-stream. SmolLM2 with a tool-format template answers where
the model's output matters: tools (named ``tool_choice``, whole and streamed) and ``text.format`` json_schema.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from gateway_helpers import DB_URL, gateway_stack, openai_client, read_sse
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.job import JobField
from pagestream.worker.fake_engine import FakeTokenizer
from queue_helpers import WorkerProc, wait_for

pytestmark = pytest.mark.slow

MODEL = "fake-resp"
KEYS = "ka:alice,kb:bob"
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("responses")
    with gateway_stack(DB_URL, log_dir, MODEL, "resp-a", "--lease-ms", "1500", engine="fake:25",
                       gateway_env={"PAGESTREAM_GATEWAY_API_KEYS": KEYS}) as s:
        s["alice"] = openai_client(s["gw"], "ka")
        s["bob"] = openai_client(s["gw"], "kb")
        s["extra_workers"] = []
        yield s
        for w in s["extra_workers"]:
            w.stop()


def _prompt_tokens(messages: list[dict]) -> int:
    return len(FakeTokenizer().apply_chat_template(messages, tokenize=True))


def _queued(r) -> int:
    return sum(r.xlen(s) for lane in keys.LANES for s in keys.lane_stream_shards(lane, MODEL) if r.exists(s))


def test_create_whole_answers_a_response_the_sdk_validates_and_retrieve_returns_it(stack):
    client = stack["alice"]
    resp = client.responses.create(model=MODEL, input="hello there", instructions="be brief", max_output_tokens=12,
                                   extra_body={"seed": 3})
    Response.model_validate(resp.to_dict())  # the SDK's type, validated (the client only constructs it)
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"  # fake runs to max
    assert resp.output_text and resp.output_text.startswith("<")
    assert resp.usage.output_tokens == 12
    assert resp.usage.input_tokens == _prompt_tokens([{"role": "system", "content": "be brief"},
                                                      {"role": "user", "content": "hello there"}])
    assert resp.instructions == "be brief"
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text and got.status == resp.status
    # another tenant's key: no such response, for retrieve and for previous_response_id alike
    with pytest.raises(openai.NotFoundError):
        stack["bob"].responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        stack["bob"].responses.create(model=MODEL, input="more", previous_response_id=resp.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_doesnotexist")
    assert stack["r"].ttl(keys.response_record(resp.id)) > 0  # stored with a TTL
    # store=false: answered, not kept
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # delete
    assert client.responses.delete(resp.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_previous_response_id_over_three_turns_carries_the_conversation(stack):
    client = stack["alice"]
    history: list[dict] = []
    previous = None
    for turn, text in enumerate(["first question", "second question here", "third"]):
        resp = client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": text}]}],
                                       instructions=f"turn {turn}", previous_response_id=previous, max_output_tokens=4,
                                       extra_body={"seed": turn})
        history.append({"role": "user", "content": text})
        # the prompt: this turn's instructions (not the earlier turns'), then every earlier turn and this input
        assert resp.usage.input_tokens == _prompt_tokens([{"role": "system", "content": f"turn {turn}"}, *history])
        assert resp.previous_response_id == previous
        history.append({"role": "assistant", "content": resp.output_text})
        previous = resp.id
    assert len(history) == 6


def test_streamed_create_every_event_validates_and_the_helpers_assemble_the_answer(stack):
    client = stack["alice"]
    whole = client.responses.create(model=MODEL, input="stream me", max_output_tokens=10, extra_body={"seed": 5})
    # the raw stream: each event as sent, validated with the SDK's union of event types
    with httpx.stream("POST", f"{stack['gw'].base_url}/responses", headers={"Authorization": "Bearer ka"}, timeout=60,
                      json={"model": MODEL, "input": "stream me", "max_output_tokens": 10, "stream": True, "seed": 5}) as r:
        assert r.status_code == 200
        raw = read_sse(r)
    events = [EVENT.validate_python(json.loads(e["data"])) for e in raw]
    assert [e["event"] for e in raw] == [e.type for e in events]  # each named by its type
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 10
    # the SDK's iterator of typed events
    typed = list(client.responses.create(model=MODEL, input="stream me", max_output_tokens=10, stream=True,
                                         extra_body={"seed": 5}))
    assert [type(e).__name__ for e in typed] == [type(e).__name__ for e in events]
    # the SDK's stream helper (it accumulates the snapshot from the deltas)
    with client.responses.stream(model=MODEL, input="stream me", max_output_tokens=10, extra_body={"seed": 5}) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        helper_final = s.get_final_response()
    assert "".join(deltas) == text and helper_final.output_text == text
    # a streamed response is stored too, and retrieved completed
    assert client.responses.retrieve(final.id).output_text == text


@pytest.mark.parametrize("fields, param", [
    ({"background": True, "store": False}, "store"),  # a background response is read back: it must be stored
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"type": "input_image", "image_url": "http://x/y.png"}]}, "input.0.type"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
])
def test_unsupported_fields_are_a_400_naming_them_before_anything_is_queued(stack, fields, param):
    before = _queued(stack["r"])
    with pytest.raises(openai.BadRequestError) as exc:
        stack["alice"].responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body=fields)
    assert exc.value.body["param"] == param, exc.value.body
    assert _queued(stack["r"]) == before


def test_a_client_that_leaves_a_stream_has_its_job_cancelled(stack):
    with httpx.stream("POST", f"{stack['gw'].base_url}/responses", headers={"Authorization": "Bearer ka"}, timeout=60,
                      json={"model": MODEL, "input": "leave early", "max_output_tokens": 400, "stream": True}) as r:
        events = read_sse(r, stop_after=5)
    rid = json.loads(events[0]["data"])["response"]["id"]
    job = keys.job_hash(rid.removeprefix("resp_"))
    # 400 tokens at 25 ms a step run 10 s; gone, the job is cancelled within a step or two of the gateway noticing
    wait_for(lambda: stack["r"].hget(job, "status") == b"cancelled", 5, "the abandoned stream's job cancelled")


def test_a_tool_with_an_invalid_schema_is_a_400_naming_it(stack):
    with pytest.raises(openai.BadRequestError) as exc:
        stack["alice"].responses.create(model=MODEL, input="hi", tools=[
            {"type": "function", "name": "f", "parameters": {"type": "no-such-type"}}])
    assert exc.value.body["param"].startswith("tools.0.parameters"), exc.value.body


def test_a_worker_killed_mid_stream_the_client_still_gets_the_whole_answer_exactly_once(stack, tmp_path):
    """kill -9 of the worker running a streamed response: another worker reclaims the job once its lease ends
    and resumes it from the tokens already published; the client's events carry every token once, in order."""
    client = stack["alice"]
    ask = {"model": MODEL, "input": "a long answer please", "max_output_tokens": 120, "extra_body": {"seed": 11}}
    expected = client.responses.create(**ask).output_text
    stream = client.responses.create(**ask, stream=True)
    events, killed = [], threading.Event()
    for ev in stream:
        events.append(ev)
        if not killed.is_set() and sum(e.type == "response.output_text.delta" for e in events) >= 10:
            stack["worker"].kill9()  # mid-stream; then a second worker comes up to take the job over
            killed.set()
            stack["extra_workers"].append(WorkerProc(DB_URL, "fake:25", "resp-b", "--served-model-name", MODEL,
                                                     "--lease-ms", "1500", log_dir=tmp_path))
    assert killed.is_set()
    for ev in events:
        EVENT.validate_python(ev.to_dict())
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == expected
    assert events[-1].type == "response.completed" and events[-1].response.status == "incomplete" and events[-1].response.output_text == expected
    assert events[-1].response.usage.output_tokens == 120
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the job really was taken over: its second delivery ran on the second worker
    job = stack["r"].hgetall(keys.job_hash(events[-1].response.id.removeprefix("resp_")))
    assert job[JobField.WORKER.encode()] == b"resp-b" and int(job[JobField.DELIVERIES.encode()]) == 2, job
    # the job really was taken over: its second delivery ran on the second worker
    job = stack["r"].hgetall(keys.job_hash(events[-1].response.id.removeprefix("resp_")))
    assert job[JobField.WORKER.encode()] == b"resp-b" and int(job[JobField.DELIVERIES.encode()]) == 2, job


# ---- background mode and cancel ----------------------------------------------------------------------------

def _settled(client, rid: str, timeout: float = 30) -> tuple[Response, list[str]]:
    """Poll ``retrieve`` until the response leaves queued / in_progress: the final object and every status seen."""
    seen: list[str] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = client.responses.retrieve(rid)
        if not seen or seen[-1] != got.status:
            seen.append(got.status)
        if got.status not in ("queued", "in_progress"):
            return got, seen
        time.sleep(0.05)
    raise AssertionError(f"{rid} still {seen[-1]} after {timeout} s")


def _tokens_out(stack, rid: str) -> int:
    return stack["r"].xlen(keys.out_stream(rid.removeprefix("resp_")))


def _live_workers(stack) -> list[WorkerProc]:
    return [w for w in [stack["worker"], *stack["extra_workers"]] if w.proc.poll() is None]


def test_background_create_answers_queued_and_retrieve_follows_its_job_to_the_answer(stack):
    client = stack["alice"]
    ask = {"model": MODEL, "input": "in the background", "max_output_tokens": 40, "extra_body": {"seed": 21}}
    expected = client.responses.create(**ask).output_text
    t0 = time.monotonic()
    resp = client.responses.create(**ask, background=True)
    assert time.monotonic() - t0 < 0.9  # 40 tokens at 25 ms a step take a second: answered before they are made
    Response.model_validate(resp.to_dict())
    assert resp.status == "queued" and resp.background is True and resp.output == []
    final, seen = _settled(client, resp.id)
    assert "in_progress" in seen, seen  # it was seen running, then its answer
    Response.model_validate(final.to_dict())
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == expected and final.usage.output_tokens == 40 and final.background is True
    # another tenant's key sees no such response: retrieve, cancel and stream alike
    with pytest.raises(openai.NotFoundError):
        stack["bob"].responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        stack["bob"].responses.cancel(resp.id)
    with pytest.raises(openai.NotFoundError):
        stack["bob"].responses.retrieve(resp.id, stream=True)
    # cancelling a finished response answers it unchanged (OpenAI: cancel is idempotent)
    again = client.responses.cancel(resp.id)
    assert again.status == "incomplete" and again.output_text == expected
    # the answer continues a conversation like any stored one
    nxt = client.responses.create(model=MODEL, input="more", previous_response_id=resp.id, max_output_tokens=2)
    assert nxt.usage.input_tokens == _prompt_tokens([{"role": "user", "content": "in the background"},
                                                     {"role": "assistant", "content": expected},
                                                     {"role": "user", "content": "more"}])


def test_cancel_stops_a_running_background_response_and_refuses_what_it_cannot_cancel(stack):
    client = stack["alice"]
    resp = client.responses.create(model=MODEL, input="a long one", max_output_tokens=400, background=True)
    # 400 tokens at 25 ms a step run 10 s: cancelled once it has made a few
    wait_for(lambda: _tokens_out(stack, resp.id) >= 3, 10, "the background response's first tokens")
    cancelled = client.responses.cancel(resp.id)
    Response.model_validate(cancelled.to_dict())
    assert cancelled.id == resp.id and cancelled.status == "cancelled"
    job = keys.job_hash(resp.id.removeprefix("resp_"))
    wait_for(lambda: stack["r"].hget(job, JobField.STATUS) == b"cancelled", 5, "the job cancelled at the worker")
    made = _tokens_out(stack, resp.id)
    time.sleep(0.5)  # 20 steps' worth: the worker spends none on it any more
    assert _tokens_out(stack, resp.id) == made and made < 100
    assert client.responses.retrieve(resp.id).status == "cancelled"
    assert client.responses.cancel(resp.id).status == "cancelled"  # twice: the same answer
    # a response not created in the background cannot be cancelled; an unknown id is a 404
    sync = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.cancel(sync.id)
    assert "synchronous" in exc.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_doesnotexist")
    # nor streamed again: only a background response is
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.retrieve(sync.id, stream=True)
    assert exc.value.body["param"] == "stream"


def test_a_background_stream_left_early_runs_on_and_resumes_after_its_last_event(stack):
    client = stack["alice"]
    ask = {"model": MODEL, "input": "stream in the background", "max_output_tokens": 30, "seed": 4}
    expected = client.responses.create(**{k: v for k, v in ask.items() if k != "seed"}, extra_body={"seed": 4}).output_text
    with httpx.stream("POST", f"{stack['gw'].base_url}/responses", headers={"Authorization": "Bearer ka"}, timeout=60,
                      json={**ask, "stream": True, "background": True}) as r:
        assert r.status_code == 200
        first = [EVENT.validate_python(json.loads(e["data"])) for e in read_sse(r, stop_after=8)]
    rid = first[0].response.id
    assert first[0].response.background is True
    last = first[-1].sequence_number
    # the client is gone; the response is not cancelled: the rest of its events, numbered on from where it left
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=last))
    for ev in rest:
        EVENT.validate_python(ev.to_dict())
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].type == "response.completed" and events[-1].response.output_text == expected
    assert client.responses.retrieve(rid).output_text == expected  # and stored
    # from the start, once more: the same events
    again = list(client.responses.retrieve(rid, stream=True))
    assert [(e.type, e.sequence_number) for e in again] == [(e.type, e.sequence_number) for e in events]


def test_a_background_response_survives_its_worker_killed(stack, tmp_path):
    """kill -9 of the worker running a background response: another worker reclaims its job once the lease
    ends and resumes it; the stored answer is the whole one, as if nothing had happened."""
    client = stack["alice"]
    ask = {"model": MODEL, "input": "survive a crash", "max_output_tokens": 120, "extra_body": {"seed": 12}}
    expected = client.responses.create(**ask).output_text
    resp = client.responses.create(**ask, background=True)
    job = keys.job_hash(resp.id.removeprefix("resp_"))
    wait_for(lambda: _tokens_out(stack, resp.id) >= 10, 10, "the background response's first tokens")
    running = stack["r"].hget(job, JobField.WORKER).decode()
    (victim,) = [w for w in _live_workers(stack) if w.consumer == running]
    victim.kill9()
    assert client.responses.retrieve(resp.id).status == "in_progress"
    stack["extra_workers"].append(WorkerProc(DB_URL, "fake:25", "resp-c", "--served-model-name", MODEL,
                                             "--lease-ms", "1500", log_dir=tmp_path))
    final, _ = _settled(client, resp.id, timeout=60)
    assert final.status == "incomplete" and final.output_text == expected and final.usage.output_tokens == 120
    fields = stack["r"].hgetall(job)
    assert fields[JobField.WORKER.encode()] == b"resp-c" and int(fields[JobField.DELIVERIES.encode()]) == 2, fields


# ---- SmolLM2 with a tool-format template: where the model's output matters -------------------------------

SMOL = "smol-resp-tools"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def smol(stack, smollm2_dir, tmp_path_factory):
    """SmolLM2's weights and tokenizer with a Qwen2.5-style tool template (as test_tool_calls serves it), on the
    fake stack's Redis and a gateway of its own that reads ``auto`` calls with the hermes parser."""
    from pagestream.producer import Producer
    from gateway_helpers import GatewayProc

    log_dir = tmp_path_factory.mktemp("responses-smol")
    model_dir = log_dir / "smollm2-tools"
    model_dir.mkdir()
    for f in Path(smollm2_dir).iterdir():
        if f.name != "chat_template.jinja":
            (model_dir / f.name).symlink_to(f)
    (model_dir / "chat_template.jinja").write_text((Path(__file__).parent / "qwen2_tool_template.jinja").read_text())
    worker = WorkerProc(DB_URL, str(model_dir), "resp-smol", "--served-model-name", SMOL, "--max-num-seqs", "4",
                        "--max-model-len", "2048", log_dir=log_dir)
    gw = GatewayProc(DB_URL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", log_dir=log_dir,
                     env={"PAGESTREAM_GATEWAY_API_KEYS": KEYS})
    try:
        worker.wait_ready(300)
        gw.wait_ready()
        wait_for(lambda: SMOL in Producer(stack["r"]).live_models(), 60, "the smol worker's announcement")
        yield openai_client(gw, "ka", timeout=300)
    finally:
        gw.stop()
        worker.stop()


def test_a_named_tool_answers_a_function_call_and_its_output_continues_the_conversation(smol):
    first = smol.responses.create(model=SMOL, input="What is the weather in Paris?", tools=TOOLS, tool_choice=NAMED,
                                  max_output_tokens=80, temperature=0)
    Response.model_validate(first.to_dict())
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # turn two: the tool's result as a function_call_output item, continuing the stored conversation
    second = smol.responses.create(model=SMOL, previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                                   input=[{"type": "function_call_output", "call_id": call.call_id,
                                           "output": json.dumps({"temperature": 21, "unit": "celsius"})}],
                                   max_output_tokens=24, temperature=0)
    assert second.output[0].type == "message" and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the call and result


def test_a_named_tool_streamed_validates_every_event_and_equals_the_whole_answer(smol):
    ask = dict(model=SMOL, input="What is the weather in Paris?", tools=TOOLS, tool_choice=NAMED, max_output_tokens=80,
               temperature=0)
    whole = smol.responses.create(**ask)
    events = list(smol.responses.create(**ask, stream=True))
    for ev in events:
        EVENT.validate_python(ev.to_dict())
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == whole.output[0].arguments
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output[0].type == "function_call"
    assert final.output[0].name == "get_weather" and final.output[0].arguments == whole.output[0].arguments
    with smol.responses.stream(**ask) as s:
        for _ in s:
            pass
        assert s.get_final_response().output[0].arguments == whole.output[0].arguments


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


def test_text_format_json_schema_is_structured_output(smol):
    parsed = smol.responses.parse(model=SMOL, input="Name a city in France as JSON.", text_format=City,
                                  max_output_tokens=60, temperature=0)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City), parsed.output_text
    jsonschema.validate(json.loads(parsed.output_text), City.model_json_schema())
