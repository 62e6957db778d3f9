"""A hypothesis suite over the gateway's HTTP surface (issue 22): JSON bodies (valid-ish and hostile) for
/v1/completions, /v1/chat/completions and /v1/batches, multipart uploads to /v1/files, query parameters,
path ids and headers, against a gateway process and a fake-engine worker (max-model-len 128, so anything
that generates is short). Every answer is a 2xx or a 4xx with a JSON body in OpenAI's error shape,
never a 500 or a reset; afterwards the gateway is alive and its RSS has grown by less than 200 MB.

About 2,000 cases in all, derandomized (the same inputs each run); ``PAGESTREAM_FUZZ_RANDOM=1`` explores.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_helpers import DB_URL, GatewayProc
from queue_helpers import WorkerProc, wait_for

MODEL = "fuzz"
FUZZ = settings(deadline=None, derandomize=not os.environ.get("PAGESTREAM_FUZZ_RANDOM"), database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from pagestream.producer import Producer

    log_dir = tmp_path_factory.mktemp("fuzz")
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    worker = WorkerProc(DB_URL, "fake:5", "fuzz-w", "--served-model-name", MODEL, "--max-model-len", "128",
                        log_dir=log_dir)
    gw = GatewayProc(DB_URL, log_dir=log_dir, env={"PAGESTREAM_GATEWAY_FILES_URI": str(tmp_path_factory.mktemp("files")),
                                                    "PAGESTREAM_GATEWAY_MAX_FILE_BYTES": str(64 * 1024)})
    try:
        worker.wait_ready()
        gw.wait_ready()
        wait_for(lambda: MODEL in Producer(r).live_models(), 60, "the worker's announcement")
        with httpx.Client(base_url=f"http://127.0.0.1:{gw.port}", timeout=30) as client:
            yield {"gw": gw, "client": client, "rss0": _rss(gw)}
    finally:
        gw.stop()
        worker.stop()
        r.flushdb()
        r.close()


def _rss(gw: GatewayProc) -> int:
    for line in Path(f"/proc/{gw.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def check(r: httpx.Response) -> None:
    """A 2xx or 4xx; a JSON body (an event stream for a 200 stream), errors in OpenAI's shape."""
    assert r.status_code < 500 and r.status_code >= 200, (r.status_code, r.request.method, r.request.url, r.text[:500])
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        return
    if r.request.url.path.endswith("/content") and r.status_code == 200:
        return
    body = r.json()
    if r.status_code >= 400:
        err = body["error"]
        assert set(err) >= {"message", "type", "param", "code"}, body
        assert isinstance(err["message"], str) and err["message"], body


scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 300)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=10), kids, max_size=4), max_leaves=12)
small_ints = st.integers(-2, 12)
COMMON = {
    "model": st.sampled_from([MODEL, MODEL, MODEL, "nope", ""]) | json_values,
    "max_tokens": small_ints | st.integers(-2**63, 2**64) | json_values,
    "n": st.integers(-1, 3) | json_values, "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5) | json_values, "top_k": st.integers(-2, 50) | json_values,
    "min_p": st.floats(-1, 2) | json_values, "seed": st.integers(-2**64, 2**64) | json_values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=5) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values,
                                                          "continuous_usage_stats": st.booleans()}) | json_values,
    "presence_penalty": st.floats(-3, 3) | json_values, "frequency_penalty": st.floats(-3, 3) | json_values,
    "repetition_penalty": st.floats(-1, 3) | json_values, "min_tokens": small_ints | json_values,
    "ignore_eos": st.booleans() | json_values, "stop_token_ids": st.lists(st.integers(-5, 2**40), max_size=4) | json_values,
    "logit_bias": st.dictionaries(st.text(max_size=6), st.floats(-200, 200), max_size=3) | json_values,
    "skip_special_tokens": st.booleans() | json_values, "return_token_ids": st.booleans() | json_values,
    "prompt_logprobs": json_values, "allowed_token_ids": json_values,
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
                                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                                        {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}]) | json_values,
    "guided_regex": st.sampled_from(["[a-z]+", "(", "a{99999}"]) | json_values,
    "guided_choice": st.lists(st.text(max_size=5), max_size=3) | json_values, "guided_json": json_values,
    "user": json_values, "extra": json_values,
}
token_ids = st.lists(st.integers(-3, 2**33) | st.integers(0, 300), max_size=8)
COMPLETION = {**COMMON,
              "prompt": st.text(max_size=40) | token_ids | st.lists(st.text(max_size=10) | token_ids, max_size=3) | json_values,
              "echo": st.booleans() | json_values, "logprobs": st.integers(-1, 30) | st.booleans() | json_values,
              "suffix": json_values, "best_of": st.integers(-1, 3) | json_values,
              "truncate_prompt_tokens": st.integers(-3, 200) | json_values,
              "truncation_side": st.sampled_from(["left", "right", "middle"]) | json_values}
content_part = (st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10) | json_values})
                | st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "refusal", ""])}) | json_values)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "nobody"]) | json_values},
    optional={"content": st.text(max_size=30) | st.lists(content_part, max_size=3) | json_values,
              "name": json_values, "tool_calls": json_values, "tool_call_id": json_values})
CHAT = {**COMMON, "messages": st.lists(message, max_size=4) | json_values,
        "max_completion_tokens": small_ints | json_values, "logprobs": st.booleans() | json_values,
        "top_logprobs": st.integers(-1, 30) | json_values, "echo": st.booleans() | json_values,
        "add_generation_prompt": st.booleans() | json_values, "continue_final_message": st.booleans() | json_values,
        "chat_template": st.sampled_from(["{{ messages }}", "{% for %}", "{{ raise_exception('x') }}"]) | json_values,
        "chat_template_kwargs": st.dictionaries(st.text(max_size=8), json_values, max_size=3) | json_values,
        "tools": json_values, "tool_choice": json_values}
BATCH = {"input_file_id": st.sampled_from(["file-abc", "", "file-" + "x" * 300]) | json_values,
         "endpoint": st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings", ""]) | json_values,
         "completion_window": st.sampled_from(["24h", "1h", ""]) | json_values,
         "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=600) | json_values, max_size=20) | json_values}


def body_for(fields: dict) -> st.SearchStrategy:
    """Mostly the request's own fields (some required ones kept), sometimes hostile JSON of any shape."""
    required = {k: fields[k] for k in ("model", "prompt", "messages") if k in fields}
    built = st.fixed_dictionaries(required, optional={k: v for k, v in fields.items() if k not in required})
    loose = st.fixed_dictionaries({}, optional=fields)
    return st.one_of(built, built, built, loose, json_values)


def post_json(client: httpx.Client, path: str, body) -> httpx.Response:
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


@settings(FUZZ, max_examples=450)
@given(body=body_for(COMPLETION))
def test_completions_bodies(stack, body):
    check(post_json(stack["client"], "/v1/completions", body))


@settings(FUZZ, max_examples=350)
@given(body=body_for(CHAT))
def test_chat_bodies(stack, body):
    check(post_json(stack["client"], "/v1/chat/completions", body))


@settings(FUZZ, max_examples=250)
@given(body=body_for(BATCH))
def test_batch_bodies(stack, body):
    check(post_json(stack["client"], "/v1/batches", body))


lines = st.lists(st.fixed_dictionaries({"custom_id": json_values, "method": st.just("POST") | json_values,
                                        "url": st.sampled_from(["/v1/completions", "/v1/chat/completions"]) | json_values,
                                        "body": json_values}).map(json.dumps) | st.text(max_size=40), max_size=5)


@settings(FUZZ, max_examples=200)
@given(purpose=st.sampled_from(["batch", "fine-tune", "", "x" * 100]) | st.text(max_size=10),
       content=lines.map(lambda ls: "\n".join(ls).encode()) | st.binary(max_size=300),
       filename=st.text(max_size=30), extra=st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=3),
       drop=st.sampled_from(["", "purpose", "file"]))
def test_file_uploads(stack, purpose, content, filename, extra, drop):
    data = {**extra, **({} if drop == "purpose" else {"purpose": purpose})}
    files = {} if drop == "file" else {"file": (filename or "f", content, "application/jsonl")}
    r = stack["client"].post("/v1/files", data=data, files=files or None)
    check(r)
    if r.status_code == 200 and "batch" == purpose:
        fid = r.json()["id"]
        check(stack["client"].post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                         "completion_window": "24h"}))


query_value = st.text(max_size=12) | st.integers(-5, 2**70).map(str) | st.sampled_from(["asc", "desc", "true", ""])


@settings(FUZZ, max_examples=400)
@given(path=st.sampled_from(["/v1/files", "/v1/batches", "/v1/models", "/v1/files/{id}", "/v1/files/{id}/content",
                             "/v1/batches/{id}", "/v1/models/{id}", "/health", "/load", "/version", "/ping"]),
       ident=st.text(max_size=40) | st.sampled_from(["file-abc", "batch_abc", MODEL, "..", "%00", "a/b"]),
       params=st.dictionaries(st.sampled_from(["limit", "after", "order", "purpose", "x"]) | st.text(max_size=5),
                              query_value, max_size=4),
       method=st.sampled_from(["GET", "GET", "GET", "DELETE", "POST"]))
def test_query_parameters_and_path_ids(stack, path, ident, params, method):
    url = path.replace("{id}", quote(ident, safe="") or "x")
    check(stack["client"].request(method, url, params=params))


# a field value as HTTP carries it: no leading or trailing whitespace (h11 refuses to send b" ", so the client, not the gateway, would fail)
header_value = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(str.strip)


@settings(FUZZ, max_examples=300)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/batches", "/v1/files"]),
       content_type=st.sampled_from(["application/json", "text/plain", "multipart/form-data",
                                     "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", ""])
       | header_value,
       headers=st.dictionaries(st.sampled_from(["authorization", "accept", "content-encoding", "x-request-id",
                                                "accept-encoding", "expect"]), header_value, max_size=3),
       raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_headers_and_raw_bodies(stack, path, content_type, headers, raw):
    check(stack["client"].post(path, content=raw, headers={**headers, "content-type": content_type}))


def test_zz_the_gateway_is_alive_and_its_memory_bounded_after(stack):
    assert stack["gw"].healthy()
    grown = _rss(stack["gw"]) - stack["rss0"]
    assert grown < 200 * 1024 * 1024, f"RSS grew {grown / 2**20:.0f} MB"
