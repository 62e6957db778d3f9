"""Issue 24, the endpoints vLLM serves beside the OpenAI ones, against a real Redis, a gateway process and a worker
running the fake engine: model retrieve with vLLM's model object, /ping, /version, /load and /invocations."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import redis

from gateway_helpers import DB_URL, GatewayProc
from pagestream.producer import Producer
from pagestream.worker.fake_engine import FakeEngine
from queue_helpers import WorkerProc, wait_for

MODEL = "fake-endpoints"
ROOT = "fake:20"  # the worker's --model, 20 ms a step: a 40-token stream stays open a second


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    log_dir = tmp_path_factory.mktemp("gateway-endpoints")
    worker = WorkerProc(DB_URL, ROOT, "gw-endpoints-worker", "--served-model-name", MODEL, "--max-model-len", "1024",
                        log_dir=log_dir)
    gw = GatewayProc(DB_URL, log_dir=log_dir)
    try:
        worker.wait_ready()
        gw.wait_ready()
        wait_for(lambda: MODEL in Producer(r).live_models(), 30, "the worker's announcement")
        root = gw.base_url.removesuffix("/v1")
        yield {"root": root, "http": httpx.Client(base_url=root, timeout=60),
               "client": openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=60)}
    finally:
        gw.stop()
        worker.stop()
        r.flushdb()
        r.close()


def test_models_retrieve_answers_vllms_model_object_and_404_for_an_unknown_model(stack):
    model = stack["client"].models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    extra = model.model_extra
    assert extra["root"] == ROOT and extra["parent"] is None and extra["max_model_len"] == 1024
    listed = stack["client"].models.list().data
    assert [m.id for m in listed] == [MODEL] and listed[0].model_extra["max_model_len"] == 1024

    with pytest.raises(openai.NotFoundError) as err:
        stack["client"].models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and "no-such-model" in err.value.body["message"]


def test_ping_answers_get_and_post_and_version_names_the_package(stack):
    http = stack["http"]
    for method in ("GET", "POST"):
        resp = http.request(method, "/ping")
        assert resp.status_code == 200, (method, resp.text)
    version = http.get("/version")
    assert version.status_code == 200 and version.json()["version"] not in ("", "unknown")


def test_load_counts_the_requests_in_flight_a_stream_until_it_ends(stack):
    http = stack["http"]
    assert http.get("/load").json() == {"server_load": 0}
    seen: list[int] = []
    opened = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "count me", "max_tokens": 60, "stream": True}
        with httpx.stream("POST", f"{stack['root']}/v1/completions", json=body, timeout=60) as resp:
            for _ in resp.iter_lines():
                opened.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert opened.wait(30)
    seen.append(http.get("/load").json()["server_load"])
    reader.join(60)
    assert seen == [1]
    wait_for(lambda: http.get("/load").json()["server_load"] == 0, 10, "the load back to 0")


def test_invocations_routes_by_the_bodys_shape(stack):
    http, fake = stack["http"], FakeEngine()
    done = http.post("/invocations", json={"model": MODEL, "prompt": "a completion", "max_tokens": 3, "seed": 2})
    assert done.status_code == 200 and done.json()["object"] == "text_completion"
    assert done.json()["choices"][0]["text"] == fake.expected_text("a completion", 2, 3)

    chat = http.post("/invocations", json={"model": MODEL, "max_tokens": 3,
                                           "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"

    neither = http.post("/invocations", json={"model": MODEL, "input": "what am I"})
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]
    unknown = http.post("/invocations", json={"model": "no-such-model", "prompt": "x"})
    assert unknown.status_code == 404
