"""Tools in Batch API lines (issue 26: "through the queue and bulk as well"): the official openai client uploads a
file and creates a batch on a gateway, a bulk-worker runs it on SmolLM2 (CPU, with test_tool_calls.py's
Qwen2.5-style tool template), and each output line's ``response.body`` answers what the same gateway's
``/v1/chat/completions`` answers for the same body (greedy, so comparable): the same calls, ``content`` and
``finish_reason``; only the calls' random ids differ.

The batch gateway has no ``--tool-call-parser``, so its ``auto`` line is an error line with vLLM's message; a second
gateway with ``--enable-auto-tool-choice --tool-call-parser hermes`` creates a batch that keeps its parser."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from gateway_helpers import DB_URL, GatewayProc, batch_stack
from test_gateway_batches import upload, wait_final
from test_tool_calls import ASK, HERMES_CALL, SCHEMAS, TOOLS, TOOLS_MODEL, _tools_model

pytestmark = pytest.mark.slow

AUTO_NEEDS_PARSER = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
NAMED = {"type": "function", "function": {"name": "get_weather"}}
FORCED_CALL = {"regex": HERMES_CALL.replace("{", "\\{").replace("}", "\\}")}
BODIES = {
    "named": dict(model=TOOLS_MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=80, temperature=0),
    "required": dict(model=TOOLS_MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160, temperature=0),
    # the model's own text held to a recorded hermes call, so the parse is known (as test_tool_calls.py does)
    "auto": dict(model=TOOLS_MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=64, temperature=0,
                 structured_outputs=FORCED_CALL),
}


def test_a_tool_line_for_a_model_whose_template_has_no_tool_format_is_the_gateways_400_as_an_error_line(tmp_path):
    """As the gateway's chat endpoint: the workers' announcement says the template never reads ``tools``, so the
    line is an error line before queueing, never run with its tools dropped; lines without tools still run.
    Any bulk (``bulk submit`` too), as the same announcement is there."""
    import redis

    from pagestream.producer.bulk.api import create_bulk
    from pagestream.producer.bulk.io import parse_line
    from pagestream.producer.bulk.orchestrator import Orchestrator, bulk_job
    from pagestream.producer.protocol import keys
    from pagestream.worker.routing import announce

    r = redis.Redis.from_url(DB_URL, decode_responses=True)
    names, bulks = ("bt-plain", "bt-tools", "bt-unknown"), []
    try:
        announce(r, "bt-plain", 60, chat_tools=False)
        announce(r, "bt-tools", 60, chat_tools=True)
        announce(r, "bt-unknown", 60)  # an older worker: says nothing, so the lines run (as the gateway does)
        for served_only in (True, False):
            bulk_id = create_bulk(str(tmp_path / "in.jsonl"), str(tmp_path / f"out-{served_only}"), connection=r,
                                  served_models_only=served_only)
            bulks.append(bulk_id)
            orch = Orchestrator(r, bulk_id)
            lines = [(m, t) for m in names for t in (True, False)]
            jobs = [bulk_job(parse_line(json.dumps(_line(f"{m}-{t}", {
                "model": m, "messages": ASK, **({"tools": TOOLS, "tool_choice": "required"} if t else {})})), i + 1),
                orch.spec) for i, (m, t) in enumerate(lines)]
            kept, bad = orch._unserved(jobs, set(names))
            assert [f["output"].custom_id for f in kept] == \
                ["bt-plain-False", "bt-tools-True", "bt-tools-False", "bt-unknown-True", "bt-unknown-False"]
            (line,) = bad
            assert line.custom_id == "bt-plain-True" and line.line == 1 and line.code == "invalid_request"
            assert line.reason.startswith("the chat template of model 'bt-plain' has no tool format")
    finally:
        r.zrem(keys.model_registry(), *names)
        r.hdel(keys.model_info(), *names)
        for bulk_id in bulks:
            r.delete(keys.bulk_hash(bulk_id))
            r.zrem(keys.bulk_index(), bulk_id)
        r.close()


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    log_dir, files_dir = tmp_path_factory.mktemp("batch-tools"), tmp_path_factory.mktemp("files")
    model_dir = _tools_model(smollm2_dir, log_dir / "smollm2-tools")
    with batch_stack(log_dir, files_dir, TOOLS_MODEL, "batch-tools-worker", engine=str(model_dir),
                     worker_args=("--max-num-seqs", "4", "--max-model-len", "2048")) as s:
        hermes = GatewayProc(DB_URL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", log_dir=log_dir,
                             env={"PAGESTREAM_GATEWAY_FILES_URI": str(files_dir)})
        try:
            hermes.wait_ready()
            yield {**s, "bare": _client(s["gw"]), "hermes": _client(hermes)}
        finally:
            hermes.stop()


def _client(gw: GatewayProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=300)


def _line(cid: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _run_batch(c: openai.OpenAI, lines: list, stack, tmp_path) -> tuple[openai.types.Batch, dict, dict]:
    f = upload(c, lines, tmp_path)
    created = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_final(c, created.id, stack, timeout=600)
    assert done.status == "completed", done
    out = {o["custom_id"]: o for o in map(json.loads, c.files.content(done.output_file_id).read().splitlines())} \
        if done.output_file_id else {}
    errors = {e["custom_id"]: e for e in map(json.loads, c.files.content(done.error_file_id).read().splitlines())} \
        if done.error_file_id else {}
    return done, out, errors


def _chat(c: openai.OpenAI, body: dict) -> dict:
    """The gateway's chat completion for ``body``, as the raw JSON it sent."""
    extra = {k: body[k] for k in ("structured_outputs",) if k in body}
    rest = {k: v for k, v in body.items() if k not in extra}
    return c.chat.completions.with_raw_response.create(**rest, extra_body=extra or None).http_response.json()


def _answer(body: dict) -> list[dict]:
    """A chat.completion's choices without the calls' random ids (``chatcmpl-tool-<hex>`` each)."""
    choices = []
    for ch in body["choices"]:
        msg = dict(ch["message"])
        if msg.get("tool_calls"):
            assert all(tc["id"].startswith("chatcmpl-tool-") for tc in msg["tool_calls"])
            msg["tool_calls"] = [{k: v for k, v in tc.items() if k != "id"} for tc in msg["tool_calls"]]
        choices.append({"index": ch["index"], "message": msg, "finish_reason": ch["finish_reason"]})
    return choices


def _calls(body: dict) -> list[tuple[str, dict]]:
    calls = openai.types.chat.ChatCompletion.model_validate(body).choices[0].message.tool_calls
    assert calls
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_a_batchs_tool_lines_answer_what_the_gateways_chat_completion_answers(stack, tmp_path):
    c = stack["bare"]
    lines = [_line("named", BODIES["named"]), _line("required", BODIES["required"]), _line("auto", BODIES["auto"]),
             _line("default-auto", {k: v for k, v in BODIES["auto"].items() if k != "tool_choice"})]
    batch, out, errors = _run_batch(c, lines, stack, tmp_path)
    assert batch.request_counts.total == 4 and batch.request_counts.completed == 2 and batch.request_counts.failed == 2
    assert set(out) == {"named", "required"} and set(errors) == {"auto", "default-auto"}

    for cid in ("named", "required"):
        record = out[cid]
        assert record["error"] is None and record["response"]["status_code"] == 200
        got = record["response"]["body"]
        assert got["object"] == "chat.completion" and got["model"] == TOOLS_MODEL
        assert _answer(got) == _answer(_chat(c, BODIES[cid])), cid  # same calls, content and finish_reason
        calls = _calls(got)
        assert got["choices"][0]["message"]["content"] is None
        if cid == "named":
            assert [n for n, _ in calls] == ["get_weather"] and got["choices"][0]["finish_reason"] == "stop"
        else:
            assert got["choices"][0]["finish_reason"] == "tool_calls"

    # auto without a parser: vLLM run-batch's answer without --enable-auto-tool-choice, the gateway's 400 text
    for cid in ("auto", "default-auto"):
        assert errors[cid]["response"] is None and errors[cid]["error"]["message"] == AUTO_NEEDS_PARSER
    with pytest.raises(openai.BadRequestError, match="tool-call-parser"):
        _chat(c, BODIES["auto"])


def test_a_batch_created_on_a_gateway_with_a_parser_reads_auto_lines_with_it(stack, tmp_path):
    c = stack["hermes"]
    text = {**BODIES["auto"], "structured_outputs": {"regex": "It is sunny[.]"}}
    batch, out, errors = _run_batch(c, [_line("call", BODIES["auto"]), _line("text", text)], stack, tmp_path)
    assert not errors and set(out) == {"call", "text"}, errors
    got = out["call"]["response"]["body"]
    assert _answer(got) == _answer(_chat(c, BODIES["auto"]))
    assert _calls(got) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert got["choices"][0]["finish_reason"] == "tool_calls" and got["choices"][0]["message"]["content"] is None
    plain = out["text"]["response"]["body"]
    assert _answer(plain) == _answer(_chat(c, text))
    assert plain["choices"][0]["message"]["content"] == "It is sunny." and not plain["choices"][0]["message"].get("tool_calls")
