"""The OpenAI-compatible gateway, driven by the official openai client against a real Redis,
a gateway process and worker processes running the instant fake engine (``--model fake``)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from openai.types.completion_choice import Logprobs
import redis

from gateway_helpers import DB_URL, GatewayProc
from private_redis import PrivateRedis
from pagestream.producer import JobResult, Producer
from pagestream.producer.protocol import keys
from pagestream.worker.fake_engine import FakeEngine
from pagestream.worker.routing import announce
from queue_helpers import WorkerProc, wait_for

MODEL = "fake-model"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One worker serving MODEL (5 ms steps) and one gateway with an API key."""
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    log_dir = tmp_path_factory.mktemp("gateway")
    worker = WorkerProc(DB_URL, "fake:5", "gw-worker-a", "--served-model-name", MODEL, "--max-num-seqs", "80",
                        "--max-model-len", "2048", log_dir=log_dir)
    gw = GatewayProc(DB_URL, "--api-keys", KEY, log_dir=log_dir)
    try:
        worker.wait_ready()
        gw.wait_ready()
        wait_for(lambda: MODEL in Producer(r).live_models(), 30, "the worker's announcement")
        yield {"gw": gw, "worker": worker, "r": r, "log_dir": log_dir}
    finally:
        gw.stop()
        worker.stop()
        r.flushdb()
        r.close()


def client(stack, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["gw"].base_url, api_key=KEY, max_retries=0, timeout=120, **kw)


def result_of(r: redis.Redis, response_id: str) -> JobResult:
    raw = r.hget(keys.job_hash(response_id.split("-", 1)[1]), "result")
    return JobResult.model_validate_json(raw)


def _lane_heads(r: redis.Redis) -> dict[str, str]:
    """Each lane stream's last generated entry id: it moves with every job queued, and a worker that acks and
    deletes entries meanwhile (which a length would see) leaves it be."""
    return {s.decode(): r.xinfo_stream(s)["last-generated-id"] for s in r.scan_iter(match="ps:jobs:*", _type="stream")}


def test_models_completions_and_chat_match_the_engine(stack):
    c = client(stack)
    assert [m.id for m in c.models.list()] == [MODEL]

    done = c.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=7, seed=11)
    assert done.choices[0].text == FakeEngine().expected_text("the quick brown fox", 11, 7)
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 7 and done.usage.prompt_tokens == 4
    assert done.model == MODEL and result_of(stack["r"], done.id).model == MODEL  # the served name, in the result too

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=9, seed=5)
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, seed=5, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == full.choices[0].message.content and len(streamed) > 0
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_logprobs_in_openai_shapes_streamed_and_not(stack):
    c = client(stack)
    fake = FakeEngine()
    msgs = [{"role": "user", "content": "odds please"}]
    want = fake.expected_logprobs(fake.tokenizer.apply_chat_template(msgs), 8, 6, k=3)
    kw = dict(model=MODEL, messages=msgs, max_tokens=6, seed=8, logprobs=True, top_logprobs=3)
    raw = c.chat.completions.with_raw_response.create(**kw).http_response.json()
    full = openai.types.chat.ChatCompletion.model_validate(raw)  # strictly: the SDK itself builds objects unchecked
    content = full.choices[0].logprobs.content
    assert "".join(t.token for t in content) == full.choices[0].message.content
    for t, d in zip(content, want, strict=True):
        assert (t.token, t.logprob, t.bytes) == (f"<{next(iter(d))}>", next(iter(d.values())), list(t.token.encode()))
        assert [(a.token, a.logprob) for a in t.top_logprobs] == [(f"<{i}>", v) for i, v in d.items()]
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate(ch.model_dump())
              for ch in c.chat.completions.create(**kw, stream=True)]
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]
    # logprobs=0: the sampled token's logprob only; not asked: null
    zero = c.chat.completions.create(**{**kw, "top_logprobs": 0})
    assert [t.top_logprobs for t in zero.choices[0].logprobs.content] == [[]] * 6
    assert c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2).choices[0].logprobs is None

    want = fake.expected_logprobs("odds please", 9, 5, k=2)
    kw = dict(model=MODEL, prompt="odds please", max_tokens=5, seed=9, logprobs=2)
    raw = c.completions.with_raw_response.create(**kw).http_response.json()
    done = openai.types.Completion.model_validate(raw)
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.token_logprobs == [next(iter(d.values())) for d in want]
    assert lp.top_logprobs == [{f"<{i}>": v for i, v in d.items()} for d in want]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    # (the SDK's Completion type refuses the null finish_reason every stream chunk but the last has: check the logprobs)
    parts = [Logprobs.model_validate(ch.choices[0].logprobs.model_dump())
             for ch in c.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs]
    assert len(parts) > 1  # streamed in pieces, the offsets continue across them
    joined = {f: [x for p in parts for x in getattr(p, f)] for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == lp.model_dump()


def test_n_samples_and_stop(stack):
    c = client(stack)
    two = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pick two"}], n=2, max_tokens=6, seed=3)
    assert [ch.index for ch in two.choices] == [0, 1]
    assert two.choices[0].message.content != two.choices[1].message.content
    assert two.usage.completion_tokens == 12
    stream = c.completions.create(model=MODEL, prompt="pick two", n=2, max_tokens=6, seed=3, stream=True)
    texts = {0: "", 1: ""}
    for ch in stream:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts[0] == FakeEngine().expected_text("pick two", 3, 6, sample=0)
    assert texts[1] == FakeEngine().expected_text("pick two", 3, 6, sample=1)


def test_bad_requests_get_openai_errors_and_never_reach_a_worker(stack):
    r = stack["r"]
    c = client(stack)
    before = _lane_heads(r)
    jobs_before = len(list(r.scan_iter(match="ps:job:*")))
    cases = [
        (openai.BadRequestError, lambda: c.chat.completions.create(model=MODEL, messages=None)),  # missing field (400, as vLLM)
        (openai.BadRequestError, lambda: c.completions.create(model=MODEL, prompt="x", max_tokens="lots")),
        (openai.BadRequestError, lambda: c.completions.create(model=MODEL, prompt="x", max_tokens=4096)),  # over the context
        (openai.BadRequestError, lambda: c.completions.create(model=MODEL, prompt="x", temperature=-1)),
        # logprobs out of range (0-20), and top_logprobs without logprobs: true
        (openai.BadRequestError, lambda: c.completions.create(model=MODEL, prompt="x", logprobs=21)),
        (openai.BadRequestError, lambda: c.completions.create(model=MODEL, prompt="x", logprobs=-1)),
        (openai.BadRequestError, lambda: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                                   logprobs=True, top_logprobs=21)),
        (openai.BadRequestError, lambda: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                                   top_logprobs=2)),
        (openai.BadRequestError, lambda: c.completions.create(model=MODEL, prompt="x", logprobs="many")),
        (openai.BadRequestError, lambda: c.completions.create(model=MODEL, prompt="x", logprobs=True)),  # chat's spelling
        (openai.NotFoundError, lambda: c.completions.create(model="no-such-model", prompt="x")),
        (openai.AuthenticationError, lambda: openai.OpenAI(base_url=stack["gw"].base_url, api_key="wrong", max_retries=0)
         .completions.create(model=MODEL, prompt="x")),
    ]
    params = []
    for exc_type, call in cases:
        with pytest.raises(exc_type) as info:
            call()
        body = info.value.body
        assert isinstance(body, dict) and body.get("message"), body  # OpenAI's error object
        params.append(body.get("param"))
    assert params[4:8] == ["logprobs", "logprobs", "top_logprobs", "top_logprobs"]  # the field the client sent
    assert cases and info.value.status_code == 401
    with pytest.raises(openai.NotFoundError) as nf:
        c.completions.create(model="no-such-model", prompt="x")
    assert nf.value.code == "model_not_found"

    url = stack["gw"].base_url + "/completions"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    raw = httpx.post(url, content=b"{not json", headers=auth, timeout=60)
    assert raw.status_code == 400 and "JSON" in raw.json()["error"]["message"]
    huge = json.dumps({"model": MODEL, "prompt": "x" * (10 * 1024 * 1024)})
    big = httpx.post(url, content=huge, headers=auth, timeout=120)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

    assert _lane_heads(r) == before and len(list(r.scan_iter(match="ps:job:*"))) == jobs_before
    ok = c.completions.create(model=MODEL, prompt="still serving", max_tokens=3, seed=1)  # the gateway keeps serving
    assert ok.choices[0].text == FakeEngine().expected_text("still serving", 1, 3)


def test_64_concurrent_streams_are_complete_and_correct(stack):
    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        prompt = f"client {i} says hello"
        stream = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=24, seed=i, stream=True)
        text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        return text, FakeEngine().expected_text(prompt, i, 24)

    async def main():
        async with openai.AsyncOpenAI(base_url=stack["gw"].base_url, api_key=KEY, max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64
    for got, want in results:
        assert got == want


def test_open_streams_share_one_redis_read_and_all_end_exact(stack):
    """100 streams open at once (the worker runs 80 at a time, 5 ms a token): every one complete and
    exact, while the gateway blocks in at most one XREAD on Redis instead of one per stream."""
    r, db = stack["r"], r_db(stack["r"])
    blocked_reads: list[int] = []
    done = asyncio.Event()

    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        prompt = f"held {i}"
        stream = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=60, seed=i, stream=True)
        text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        return text, FakeEngine().expected_text(prompt, i, 60)

    async def watch() -> None:  # every XREAD some client of this db is blocked in (the worker's cancel reader too)
        while not done.is_set():
            clients = await asyncio.to_thread(r.client_list)
            blocked_reads.append(sum(1 for c in clients if c.get("db") == db and c.get("cmd") == "xread" and "b" in c.get("flags", "")))
            await asyncio.sleep(0.05)

    async def main():
        watcher = asyncio.create_task(watch())
        limits = httpx.Limits(max_connections=128)
        async with openai.AsyncOpenAI(base_url=stack["gw"].base_url, api_key=KEY, max_retries=0, timeout=300,
                                      http_client=httpx.AsyncClient(limits=limits, timeout=300)) as ac:
            results = await asyncio.gather(*(one(ac, i) for i in range(100)))
        done.set()
        await watcher
        return results

    results = asyncio.run(main())
    assert all(got == want for got, want in results)
    assert len(blocked_reads) >= 5 and max(blocked_reads) <= 3, blocked_reads


def r_db(r: redis.Redis) -> str:
    return str(r.connection_pool.connection_kwargs.get("db", 0))


def test_a_disconnecting_client_cancels_its_job(stack):
    r = stack["r"]
    c = client(stack)
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "talk forever"}],
                                       max_tokens=1500, stream=True)
    first = [next(iter(stream)) for _ in range(3)]
    job_id = first[0].id.split("-", 1)[1]
    stream.close()  # the client goes away mid-stream
    wait_for(lambda: r.hget(keys.job_hash(job_id), "status") == b"cancelled", 60, "the job to be cancelled")
    res = result_of(r, first[0].id)
    assert res.status.value == "cancelled" and res.completion_tokens < 1500


def _metric(gw: GatewayProc, name: str, **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_count_requests_and_time_streams_apart(stack):
    gw, c = stack["gw"], client(stack)
    path = "/v1/completions"
    ok, timed, streams = (_metric(gw, "pagestream_gateway_requests_total", endpoint=path, status="200"),
                          _metric(gw, "pagestream_gateway_request_seconds_count", endpoint=path),
                          _metric(gw, "pagestream_gateway_request_seconds_count", endpoint="stream"))
    c.completions.create(model=MODEL, prompt="count me", max_tokens=2)
    list(c.completions.create(model=MODEL, prompt="count me too", max_tokens=2, stream=True))
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert _metric(gw, "pagestream_gateway_requests_total", endpoint=path, status="200") == ok + 2
    assert _metric(gw, "pagestream_gateway_requests_total", endpoint=path, status="404") >= 1
    # answered in one body: timed per path; a stream times itself, to its last event
    assert _metric(gw, "pagestream_gateway_request_seconds_count", endpoint=path) == timed + 2
    assert _metric(gw, "pagestream_gateway_request_seconds_count", endpoint="stream") == streams + 1


def test_redis_down_answers_503_in_openai_shape_and_serving_resumes(tmp_path):
    server = PrivateRedis()
    gw = GatewayProc(server.url, log_dir=tmp_path)
    try:
        announce(redis.Redis.from_url(server.url), "lonely-model", ttl_s=600)
        gw.wait_ready()
        c = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list()] == ["lonely-model"]
        server.stop()
        time.sleep(1.5)  # past the gateway's served-model cache
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as info:
                c.completions.create(model="lonely-model", prompt="anyone?", max_tokens=2, stream=stream)
            assert info.value.status_code == 503 and info.value.code == "queue_unavailable"
        assert httpx.get(f"http://127.0.0.1:{gw.port}/health", timeout=10).status_code == 503
        server.start()
        wait_for(gw.healthy, 30, "the gateway to reach Redis again")
        assert [m.id for m in c.models.list()] == ["lonely-model"]
    finally:
        gw.stop()
        server.stop()


def test_queue_past_its_depth_answers_429(stack):
    r = stack["r"]
    announce(r, "idle-model", ttl_s=120)  # announced, but no worker reads its lanes
    with Producer(redis.Redis.from_url(DB_URL)) as p:
        for i in range(3):
            p.submit(prompt=f"waiting {i}", model="idle-model")
    gw = GatewayProc(DB_URL, "--max-queue-depth", "3", log_dir=stack["log_dir"])
    try:
        gw.wait_ready()
        c = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=120)
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model="idle-model", prompt="one more")
        assert info.value.code == "queue_full"
        assert r.xlen(keys.jobs_stream("normal", "idle-model")) == 3
        assert c.completions.create(model=MODEL, prompt="short queue", max_tokens=2).choices[0].text  # other models still served
    finally:
        gw.stop()
        r.zrem(keys.model_registry(), "idle-model")


def test_two_workers_two_models_each_job_on_its_own_model(stack):
    r = stack["r"]
    other = WorkerProc(DB_URL, "fake", "gw-worker-b", "--served-model-name", "other-model", log_dir=stack["log_dir"])
    try:
        other.wait_ready()
        wait_for(lambda: "other-model" in Producer(r).live_models(), 30, "other-model announced")
        with Producer(redis.Redis.from_url(DB_URL)) as p:
            ids = {m: [p.submit(prompt=f"job {i}", model=m, max_tokens=3) for i in range(8)] for m in (MODEL, "other-model")}
            for model, consumer in ((MODEL, "gw-worker-a"), ("other-model", "gw-worker-b")):
                for jid in ids[model]:
                    res = p.result(jid, timeout=120)
                    assert res.ok and res.worker == consumer and res.model == model
        c = client(stack)
        # both listed (polled: on a loaded machine a late heartbeat can let an announcement lapse for a moment)
        wait_for(lambda: sorted(m.id for m in c.models.list()) == sorted([MODEL, "other-model"]), 15,
                 "both models on /v1/models")
        assert c.completions.create(model="other-model", prompt="hi", max_tokens=2).model == "other-model"
    finally:
        other.stop()
