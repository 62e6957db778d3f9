"""Structured outputs at the gateway (issue 23): what the official openai client sends as
``response_format`` or vLLM's ``structured_outputs`` extra field is checked before any worker
sees it (400 invalid_request_error naming the reason), and vLLM's removed ``guided_*`` fields
answer 400 naming their replacement. A good constraint is queued as the job's structured_outputs.
(The fake engine serves here; SmolLM2 runs through the engine in test_structured_engine.py.)"""
from __future__ import annotations

import json

import openai
import pytest
import redis

from gateway_helpers import DB_URL, GatewayProc
from pagestream.producer import Producer
from pagestream.producer.protocol.wire import JOB_FIELD
from queue_helpers import WorkerProc, wait_for

MODEL = "fake-model"
KEY = "sk-test-key"
MSGS = [{"role": "user", "content": "x"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    log_dir = tmp_path_factory.mktemp("gateway-structured")
    worker = WorkerProc(DB_URL, "fake:5", "gw-so-worker", "--served-model-name", MODEL, log_dir=log_dir)
    gw = GatewayProc(DB_URL, "--api-keys", KEY, log_dir=log_dir)
    try:
        worker.wait_ready()
        gw.wait_ready()
        wait_for(lambda: MODEL in Producer(r).live_models(), 30, "the worker's announcement")
        yield {"gw": gw, "r": r}
    finally:
        gw.stop()
        worker.stop()
        r.flushdb()
        r.close()


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["gw"].base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("kwargs, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "not a valid JSON schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be text, json_object or json_schema"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "not a valid regular expression"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "at least one string"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "exactly one of"),
    # issue 37: specs the engine's compiler refuses were 500s from the worker; now the same backend answers 400
    ({"extra_body": {"structured_outputs": {"regex": "(?=a)b"}}}, "Lookahead is not supported"),
    ({"extra_body": {"structured_outputs": {"grammar": 'rule ::= "a"'}}}, 'root rule with name "root" is not found'),
    ({"extra_body": {"structured_outputs": {"json": {"$ref": "#/nope"}}}}, "Cannot find field 'nope'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format.json_schema.schema cannot be compiled"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= root"}}}, "its language is empty"),
    ({"extra_body": {"guided_json": SCHEMA}}, "guided_json was removed (as in vLLM); use structured_outputs.json"),
    ({"extra_body": {"guided_choice": ["a"]}}, "use structured_outputs.choice"),
    ({"extra_body": {"guided_regex": "a+"}}, "use structured_outputs.regex"),
    ({"extra_body": {"guided_grammar": 'root ::= "a"'}}, "use structured_outputs.grammar"),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_bad_constraint_is_a_400_that_never_reaches_a_worker(stack, kwargs, reason, endpoint):
    r = stack["r"]
    c = _client(stack)
    before = len(list(r.scan_iter(match="ps:job:*")))
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "chat":
            c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, **kwargs)
        else:  # the SDK's completions.create has no response_format argument: vLLM takes it in the body
            body = {**kwargs.get("extra_body", {}), **({"response_format": kwargs["response_format"]}
                                                        if "response_format" in kwargs else {})}
            c.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
    assert reason in err.value.message
    assert err.value.body["type"] == "invalid_request_error"
    if "response_format" in kwargs:  # the param is the path the client sent, from the top of the body
        assert err.value.body["param"].startswith("response_format."), err.value.body
    assert len(list(r.scan_iter(match="ps:job:*"))) == before


@pytest.mark.parametrize("kwargs, wire", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA, "disable_additional_properties": True}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, {"choice": ["yes", "no"]}),
    ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "a"+'}}}, {"grammar": 'root ::= "a"+'}),
])
def test_a_good_constraint_is_queued_with_the_job(stack, kwargs, wire):
    resp = _client(stack).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, **kwargs)
    job_id = resp.id.split("-", 1)[1]
    r = stack["r"]
    jobs = [json.loads(f[JOB_FIELD.encode()]) for s in r.scan_iter(match="ps:jobs:*", _type="stream")
            for _, f in r.xrange(s)]
    (job,) = [j for j in jobs if j["job_id"] == job_id]  # the lane entry the worker read
    assert job["sampling"]["structured_outputs"] == wire
    assert resp.choices[0].finish_reason in ("stop", "length")
