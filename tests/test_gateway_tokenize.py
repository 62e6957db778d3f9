"""Issue 24, vLLM's tokenizer endpoints (``/tokenize``, ``/detokenize``, ``/tokenizer_info``), answered by the
worker's tokenizer through Redis: a real Redis, gateway processes and a worker running the fake engine (whose
tokenizer the tests reproduce in-process). SmolLM2's answers against transformers' are checked on the shared SmolLM2
stack (``test_gateway_smollm2.py``, ``test_tokenizer_endpoints_on_smollm2_answer_vllms_shapes_with_transformers_values``)."""
from __future__ import annotations

import time

import httpx
import pytest
import redis

from gateway_helpers import DB_URL, GatewayProc
from pagestream.producer import Producer
from pagestream.worker.fake_engine import FakeTokenizer
from pagestream.worker.routing import announce
from queue_helpers import WorkerProc, wait_for

MODEL = "fake-tokenize"
GHOST = "ghost-model"  # announced, but no worker answers its tokenizer calls
KEY = "tok-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    log_dir = tmp_path_factory.mktemp("gateway-tokenize")
    worker = WorkerProc(DB_URL, "fake:5", "gw-tokenize-worker", "--served-model-name", MODEL, "--max-model-len", "256",
                        log_dir=log_dir)
    env = {"PAGESTREAM_GATEWAY_API_KEYS": KEY, "PAGESTREAM_GATEWAY_TOKENIZER_TIMEOUT_S": "1.5"}
    gw = GatewayProc(DB_URL, log_dir=log_dir, env=env)
    gw_info = GatewayProc(DB_URL, log_dir=log_dir, env={**env, "PAGESTREAM_GATEWAY_ENABLE_TOKENIZER_INFO_ENDPOINT": "true"})
    try:
        worker.wait_ready()
        gw.wait_ready()
        gw_info.wait_ready()
        wait_for(lambda: MODEL in Producer(r).live_models(), 30, "the worker's announcement")
        yield {"r": r, "http": httpx.Client(base_url=gw.base_url.removesuffix("/v1"), timeout=30, headers=AUTH),
               "info": httpx.Client(base_url=gw_info.base_url.removesuffix("/v1"), timeout=30, headers=AUTH)}
    finally:
        gw.stop()
        gw_info.stop()
        worker.stop()
        r.flushdb()
        r.close()


def test_tokenize_a_prompt_answers_vllms_shape_with_the_workers_tokens(stack):
    tok = FakeTokenizer()
    resp = stack["http"].post("/tokenize", json={"model": MODEL, "prompt": "hello paged world"})
    assert resp.status_code == 200, resp.text
    ids = tok.encode("hello paged world", add_special_tokens=True)
    assert resp.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}

    resp = stack["http"].post("/tokenize", json={"model": MODEL, "prompt": "hello paged world", "add_special_tokens": False,
                                                  "return_token_strs": True})
    ids = tok.encode("hello paged world")
    assert resp.json()["tokens"] == ids and resp.json()["token_strs"] == tok.convert_ids_to_tokens(ids)


def test_tokenize_chat_messages_applies_the_template_with_vllms_defaults(stack):
    tok = FakeTokenizer()
    messages = [{"role": "user", "content": "what is a page?"}]
    resp = stack["http"].post("/tokenize", json={"model": MODEL, "messages": messages})
    assert resp.status_code == 200, resp.text
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))  # no special tokens added
    assert resp.json()["tokens"] == ids and resp.json()["count"] == len(ids)

    resp = stack["http"].post("/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": False,
                                                  "continue_final_message": True, "add_special_tokens": True})
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False), add_special_tokens=True)
    assert resp.status_code == 200 and resp.json()["tokens"] == ids

    both = stack["http"].post("/tokenize", json={"model": MODEL, "messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and "continue_final_message" in both.json()["error"]["message"]


def test_detokenize_round_trips_the_workers_tokenizer_and_checks_the_vocabulary(stack):
    ids = stack["http"].post("/tokenize", json={"model": MODEL, "prompt": "one two", "add_special_tokens": False}).json()["tokens"]
    resp = stack["http"].post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert resp.status_code == 200 and resp.json() == {"prompt": FakeTokenizer().decode(ids)}

    out = stack["http"].post("/detokenize", json={"model": MODEL, "tokens": [5, 10**9]})
    assert out.status_code == 400 and "vocabulary" in out.json()["error"]["message"]


def test_bad_bodies_unknown_models_and_missing_keys_are_refused(stack):
    http = stack["http"]
    for body in ({"model": MODEL}, {"model": MODEL, "prompt": 3}, {"prompt": "no model"},
                 {"model": MODEL, "messages": "not a list"}):
        resp = http.post("/tokenize", json=body)
        assert resp.status_code == 400, (body, resp.text)
    for body in ({"model": MODEL, "tokens": ["a"]}, {"model": MODEL}, {"model": MODEL, "tokens": [True]}):
        assert http.post("/detokenize", json=body).status_code == 400, body
    assert http.post("/tokenize", content=b"{not json").status_code == 400

    for path, body in (("/tokenize", {"model": "nope", "prompt": "x"}), ("/detokenize", {"model": "nope", "tokens": [1]})):
        resp = http.post(path, json=body)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text

    anon = httpx.post(f"{str(http.base_url).rstrip('/')}/tokenize", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert anon.status_code == 401


def test_a_model_whose_workers_do_not_answer_gets_a_503_within_the_timeout(stack):
    announce(stack["r"], GHOST, ttl_s=120)
    wait_for(lambda: GHOST in Producer(stack["r"]).live_models(), 10, "the ghost announcement")
    time.sleep(1.2)  # the gateway's model list is trusted for a second
    start = time.monotonic()
    resp = stack["http"].post("/tokenize", json={"model": GHOST, "prompt": "anyone?"})
    assert resp.status_code == 503, resp.text
    assert time.monotonic() - start < 5
    err = resp.json()["error"]
    assert GHOST in err["message"] and "tokenizer" in err["message"]


def test_tokenizer_info_is_404_unless_enabled_and_then_names_the_tokenizer(stack):
    off = stack["http"].get("/tokenizer_info", params={"model": MODEL})
    assert off.status_code == 404
    on = stack["info"].get("/tokenizer_info", params={"model": MODEL})
    assert on.status_code == 200, on.text
    assert on.json()["tokenizer_class"] == "FakeTokenizer"
    assert stack["info"].get("/tokenizer_info", params={"model": "nope"}).status_code == 404


def test_the_worker_skips_malformed_and_expired_calls_and_keeps_answering(stack):
    from pagestream.producer.protocol import keys
    from pagestream.producer.protocol.tokenization import TokenizerCall, TokenizerOp

    r = stack["r"]
    late = TokenizerCall(TokenizerOp.TOKENIZE, {"prompt": "too late"}, deadline_ms=int((time.time() - 5) * 1000))
    r.lpush(keys.tokenizer_calls(MODEL), b"{not a call", late.dumps())
    resp = stack["http"].post("/tokenize", json={"model": MODEL, "prompt": "still here"})
    assert resp.status_code == 200 and resp.json()["count"] == 3
    assert r.llen(keys.tokenizer_calls(MODEL)) == 0 and not r.exists(keys.tokenizer_reply(late.id))
