"""Issue 24, the gateway's part of vLLM's surface, with the official openai client against a real Redis, a
gateway process and a worker running the fake engine: batch prompts, vLLM's logprob and token-id extensions,
any chat role, chat echo, and the 400s vLLM answers before any worker step."""
from __future__ import annotations

import httpx
import openai
import pytest
import redis

from prometheus_client.parser import text_string_to_metric_families

from gateway_helpers import DB_URL, GatewayProc
from pagestream.producer import JobResult, Producer
from pagestream.producer.protocol import keys
from private_redis import free_port
from pagestream.worker.fake_engine import FakeEngine
from queue_helpers import WorkerProc, wait_for
from test_gateway import _lane_lengths

MODEL = "fake-vllm"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    log_dir = tmp_path_factory.mktemp("gateway-vllm")
    metrics_port = free_port()
    worker = WorkerProc(DB_URL, "fake:2", "gw-vllm-worker", "--served-model-name", MODEL, "--max-num-seqs", "16",
                        "--max-model-len", "2048", "--metrics-port", str(metrics_port), log_dir=log_dir)
    gw = GatewayProc(DB_URL, log_dir=log_dir)
    try:
        worker.wait_ready()
        gw.wait_ready()
        wait_for(lambda: MODEL in Producer(r).live_models(), 30, "the worker's announcement")
        yield {"gw": gw, "r": r, "metrics_port": metrics_port, "client": openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=120)}
    finally:
        gw.stop()
        worker.stop()
        r.flushdb()
        r.close()


def test_a_list_of_prompts_is_one_job_each_answered_in_openais_choice_order(stack):
    c = stack["client"]
    fake = FakeEngine()
    prompts = ["the first prompt", "a second one", "and the third"]
    done = c.completions.create(model=MODEL, prompt=prompts, max_tokens=4, seed=3, n=2)
    assert [ch.index for ch in done.choices] == list(range(6))
    for ch in done.choices:
        p, s = divmod(ch.index, 2)
        assert ch.text == fake.expected_text(prompts[p], 3, 4, sample=s)
    assert done.usage.completion_tokens == 24 and done.usage.prompt_tokens == sum(len(p.split()) for p in prompts)

    ids = [[5, 6, 7], [8, 9]]
    by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=3, seed=1)
    assert [ch.index for ch in by_ids.choices] == [0, 1] and by_ids.usage.prompt_tokens == 5

    # streamed: every choice's text equals the non-streamed one, and the usage chunk sums the prompts
    chunks = list(c.completions.create(model=MODEL, prompt=prompts, max_tokens=4, seed=3, n=2, stream=True,
                                       stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {ch.index: ch.text for ch in done.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == done.usage.total_tokens


def test_one_bad_prompt_fails_the_whole_request_before_any_job(stack):
    c, r = stack["client"], stack["r"]
    before = _lane_lengths(r)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=MODEL, prompt=[[1, 2], [3, 60_000]], max_tokens=2)  # 60000 >= the vocabulary
    assert "out of vocabulary" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt=["fine", ""], max_tokens=2)
    assert _lane_lengths(r) == before


def test_logprobs_zero_gives_the_sampled_token_and_token_ids_extensions(stack):
    c = stack["client"]
    fake = FakeEngine()
    want = fake.expected_logprobs("odds please", 9, 4, k=0)
    zero = c.completions.create(model=MODEL, prompt="odds please", max_tokens=4, seed=9, logprobs=0)
    lp = zero.choices[0].logprobs
    assert lp.top_logprobs == [{f"<{t}>": v for t, v in d.items()} for d in want]  # the sampled token's own entry
    assert all(len(d) == 1 for d in lp.top_logprobs)

    as_ids = c.completions.create(model=MODEL, prompt="odds please", max_tokens=4, seed=9, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    tokens = as_ids.choices[0].logprobs.tokens
    raw = as_ids.model_dump()["choices"][0]
    assert tokens == [f"token_id:{t}" for t in raw["token_ids"]]
    assert raw["prompt_token_ids"] == fake.tokenizer.encode("odds please")

    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, seed=2,
                                     logprobs=True, top_logprobs=1, extra_body={"return_tokens_as_token_ids": True,
                                                                                "return_token_ids": True})
    body = chat.model_dump()
    assert [t.token for t in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in body["choices"][0]["token_ids"]]
    assert body["prompt_token_ids"] == fake.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)


def test_any_chat_role_reaches_the_template_and_echo_leads_with_the_last_message(stack):
    c = stack["client"]
    fake = FakeEngine()
    msgs = [{"role": "narrator", "content": "once upon"}, {"role": "user", "content": "go on"}]
    out = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, seed=4)
    assert out.choices[0].message.content == fake.expected_text(fake.tokenizer.apply_chat_template(msgs), 4, 3)

    msgs = [{"role": "user", "content": "finish this"}, {"role": "assistant", "content": "The answer is"}]
    echoed = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, seed=4, extra_body={"echo": True})
    plain = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, seed=4)
    assert echoed.choices[0].message.content == "The answer is" + plain.choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, seed=4, stream=True,
                                                 extra_body={"echo": True}) if ch.choices)
    assert streamed == echoed.choices[0].message.content

    text = c.completions.create(model=MODEL, prompt="echo me", max_tokens=2, seed=5, echo=True)
    assert text.choices[0].text == "echo me" + fake.expected_text("echo me", 5, 2)


def test_truncate_prompt_tokens_keeps_the_side_asked_for(stack):
    c = stack["client"]
    left = c.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=2, seed=1,
                                extra_body={"truncate_prompt_tokens": 2, "return_token_ids": True})
    right = c.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=2, seed=1,
                                 extra_body={"truncate_prompt_tokens": 2, "truncation_side": "right", "return_token_ids": True})
    assert left.model_dump()["choices"][0]["prompt_token_ids"] == [4, 5] and left.usage.prompt_tokens == 2
    assert right.model_dump()["choices"][0]["prompt_token_ids"] == [1, 2]


def test_continuous_usage_stats_count_tokens_on_every_chunk(stack):
    c = stack["client"]
    chunks = list(c.completions.create(model=MODEL, prompt="count along", max_tokens=5, seed=2, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in chunks if ch.choices and ch.usage is not None]
    assert counts and counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1].usage.prompt_tokens == 2


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, "a"]]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": [-1]}, "prompt_token_ids"),
    ({"prompt": [50_001]}, "prompt"),
    ({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [99_999]}, "stop_token_ids"),
    ({"prompt": "x", "logit_bias": {"70000": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"prompt": "x", "seed": 2**63}, "seed"),
    # not in the engine yet: refused, never ignored
    ({"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
])
def test_bad_inputs_answer_400_with_the_reason_before_any_worker_step(stack, body, param):
    r = stack["r"]
    before = _lane_lengths(r)
    resp = httpx.post(stack["gw"].base_url + "/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["message"] and (err["param"] or "").startswith(param.split("_")[0]), err
    assert _lane_lengths(r) == before


def test_a_prompt_the_worker_refuses_fails_the_request_and_cancels_the_others(stack):
    c, r = stack["client"], stack["r"]
    before = set(r.scan_iter(match="ps:job:*"))
    too_long = " ".join(f"w{i}" for i in range(1900))  # with max_tokens 1000 past the 2048 context: the worker refuses it
    with pytest.raises(openai.InternalServerError) as info:
        c.completions.create(model=MODEL, prompt=["a short one", too_long, "another short one"], max_tokens=1000)
    assert "max_model_len" in info.value.body["message"]
    new = [k for k in r.scan_iter(match="ps:job:*") if k not in before and r.type(k) == b"hash"]

    def statuses() -> list[str]:
        out = []
        for k in new:
            raw = r.hget(k, "result")
            out.append(JobResult.model_validate_json(raw).status.value if raw else "pending")
        return sorted(out)

    # each short prompt would take 1000 steps of 2 ms: it is cancelled, not left running
    wait_for(lambda: statuses() == ["cancelled", "cancelled", "failed"], 30, f"the other prompts cancelled ({statuses()})")


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


#: every vllm:* name vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries
GRAFANA_GATEWAY = ("vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
                   "vllm:time_per_output_token_seconds", "vllm:time_to_first_token_seconds", "vllm:request_prompt_tokens",
                   "vllm:request_generation_tokens", "vllm:request_success", "vllm:request_queue_time_seconds",
                   "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                   "vllm:request_max_num_generation_tokens")
GRAFANA_WORKER = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc")


def _sample(fams: dict, family: str, sample: str, **labels: str) -> float:
    return sum(s.value for s in fams[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_vllm_metric_names_with_model_name_move_with_traffic(stack):
    c = stack["client"]
    gw_url = f"http://127.0.0.1:{stack['gw'].port}/metrics"
    before = _families(httpx.get(gw_url, timeout=10).text)
    c.completions.create(model=MODEL, prompt="metric me please", max_tokens=4, seed=1)
    list(c.completions.create(model=MODEL, prompt="and stream me", max_tokens=6, seed=1, stream=True))
    after = _families(httpx.get(gw_url, timeout=10).text)
    for name in GRAFANA_GATEWAY:
        assert name in after, name
        assert all(s.labels.get("model_name") == MODEL for s in after[name].samples if s.labels), name
    m = dict(model_name=MODEL)
    def moved(fam, sample, **kw):
        return _sample(after, fam, sample, **m, **kw) - (_sample(before, fam, sample, **m, **kw) if fam in before else 0)
    assert moved("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 6
    assert moved("vllm:generation_tokens", "vllm:generation_tokens_total") == 10
    assert moved("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    assert moved("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 1  # the stream's
    assert moved("vllm:time_per_output_token_seconds", "vllm:time_per_output_token_seconds_count") == 1
    assert moved("vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count") == 2
    assert moved("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 10
    # vLLM's buckets: 1-2-5 token buckets, its TTFT buckets
    les = [s.labels["le"] for s in after["vllm:request_prompt_tokens"].samples if s.name.endswith("_bucket")]
    assert les[:4] == ["1.0", "2.0", "5.0", "10.0"]

    worker = _families(httpx.get(f"http://127.0.0.1:{stack['metrics_port']}/metrics", timeout=10).text)
    for name in GRAFANA_WORKER + ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                                  "vllm:num_preemptions"):
        assert name in worker, name
    assert [s.labels["model_name"] for s in worker["vllm:num_requests_waiting"].samples] == [MODEL]
