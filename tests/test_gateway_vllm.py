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
from pagestream.producer import JobStatus, Producer
from pagestream.producer.protocol.schema import ErrorCode
from pagestream.producer.protocol import keys
from private_redis import free_port
from pagestream.worker.fake_engine import FakeEngine
from queue_helpers import WorkerProc, wait_for
from test_gateway import _lane_heads

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
    before = _lane_heads(r)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=MODEL, prompt=[[1, 2], [3, 60_000]], max_tokens=2)  # 60000 >= the vocabulary
    assert "out of vocabulary" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt=["fine", ""], max_tokens=2)
    assert _lane_heads(r) == before


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
    # -1: the context (2048 here); a prompt longer than the context alone is cut to fit with max_tokens, not refused
    whole = c.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=2, seed=1,
                                 extra_body={"truncate_prompt_tokens": -1, "return_token_ids": True})
    assert whole.model_dump()["choices"][0]["prompt_token_ids"] == [1, 2, 3, 4, 5]
    cut = c.completions.create(model=MODEL, prompt=list(range(1, 3001)), max_tokens=2,
                               extra_body={"truncate_prompt_tokens": 2000, "return_token_ids": True})
    assert cut.model_dump()["choices"][0]["prompt_token_ids"] == list(range(1001, 3001))


def test_truncate_prompt_tokens_cuts_a_text_prompt_and_a_chat_after_the_workers_tokenizer(stack):
    """The worker tokenizes a text prompt (a chat: its template applied) and keeps the side asked for; usage and
    ``return_token_ids`` show what it kept. ``echo`` is vLLM's: the prompt's text as sent (vLLM's renderer keeps the
    text and cuts only the ids), whole and streamed; none with ``return_token_ids``."""
    c, fake = stack["client"], FakeEngine()
    words = "one two three four five six"
    ids = fake.tokenizer.encode(words)
    for side, kept, kept_words in (("left", ids[-3:], "four five six"), ("right", ids[:3], "one two three")):
        cut = {"truncate_prompt_tokens": 3, "truncation_side": side}
        got = c.completions.create(model=MODEL, prompt=words, max_tokens=2, seed=4, echo=True,
                                   extra_body={**cut, "return_token_ids": True})
        choice = got.model_dump()["choices"][0]
        assert choice["prompt_token_ids"] == kept and got.usage.prompt_tokens == 3
        # the sample: that of the kept prompt alone; echo with return_token_ids: no prompt text (vLLM's)
        assert choice["text"] == fake.expected_text(kept_words, 4, 2)
        echoed = c.completions.create(model=MODEL, prompt=words, max_tokens=2, seed=4, echo=True, extra_body=cut)
        assert echoed.choices[0].text == words + fake.expected_text(kept_words, 4, 2)  # the text as sent
        assert echoed.usage.prompt_tokens == 3
        streamed = c.completions.create(model=MODEL, prompt=words, max_tokens=2, seed=4, echo=True, stream=True,
                                        extra_body=cut)
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == echoed.choices[0].text
        with_ids = c.completions.create(model=MODEL, prompt=words, max_tokens=2, seed=4, echo=True, stream=True,
                                        extra_body={**cut, "return_token_ids": True})
        assert "".join(ch.choices[0].text for ch in with_ids if ch.choices) == choice["text"]
    messages = [{"role": "user", "content": "a chat cut to its last tokens"}]
    rendered = fake.tokenizer.apply_chat_template(messages, tokenize=True)
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                     extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True})
    assert chat.model_dump()["prompt_token_ids"] == rendered[-4:] and chat.usage.prompt_tokens == 4
    right = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": 4, "truncation_side": "right",
                                                  "return_token_ids": True})
    assert right.model_dump()["prompt_token_ids"] == rendered[:4] and right.usage.prompt_tokens == 4


def test_continuous_usage_stats_count_tokens_on_every_chunk(stack):
    c = stack["client"]
    chunks = list(c.completions.create(model=MODEL, prompt="count along", max_tokens=5, seed=2, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usages = [ch.usage for ch in chunks if ch.choices and ch.usage is not None]
    counts = [u.completion_tokens for u in usages]
    assert counts and counts == sorted(counts) and counts[-1] == 5
    # vLLM's: every chunk's usage has the prompt's size (the job's first event brings it), not 0
    assert all(u.prompt_tokens == 2 and u.total_tokens == 2 + u.completion_tokens for u in usages)
    assert chunks[-1].usage.prompt_tokens == 2


def test_a_chat_streams_continuous_usage_starts_with_the_role_chunk(stack):
    """vLLM's chat stream with ``continuous_usage_stats``: the role chunks (one per choice) and chat echo's chunks
    carry the prompt's size and 0 tokens; every chunk after them its choice's tokens so far; the usage chunk last."""
    c = stack["client"]
    messages = [{"role": "user", "content": "count along"}, {"role": "assistant", "content": "one two"}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, seed=2, n=2)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, seed=2, n=2, stream=True,
                                            extra_body={"echo": True}, stream_options={"include_usage": True,
                                                                                       "continuous_usage_stats": True}))
    size = whole.usage.prompt_tokens
    assert [(ch.choices[0].delta.role, ch.usage.completion_tokens) for ch in chunks[:2]] == [("assistant", 0)] * 2
    assert [(ch.choices[0].delta.content, ch.usage.completion_tokens) for ch in chunks[2:4]] == [("one two", 0)] * 2
    assert all(ch.usage is not None and ch.usage.prompt_tokens == size for ch in chunks)
    counted: dict[int, list[int]] = {}
    for ch in chunks[:-1]:
        counted.setdefault(ch.choices[0].index, []).append(ch.usage.completion_tokens)
    assert all(v == sorted(v) and v[-1] == 4 for v in counted.values()) and sorted(counted) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 8


def test_a_stream_with_return_token_ids_gives_each_choice_its_prompts_ids_once(stack):
    c, fake = stack["client"], FakeEngine()
    prompts = ["the ids of this", "and these"]
    whole = c.completions.create(model=MODEL, prompt=prompts, max_tokens=3, seed=2, n=2,
                                 extra_body={"return_token_ids": True})
    chunks = list(c.completions.create(model=MODEL, prompt=prompts, max_tokens=3, seed=2, n=2, stream=True,
                                       extra_body={"return_token_ids": True}))
    seen: dict[int, list] = {}
    ids: dict[int, list[int]] = {}
    for ch in chunks:
        for choice in ch.model_dump()["choices"]:
            if choice.get("prompt_token_ids") is not None:
                seen.setdefault(choice["index"], []).append(choice["prompt_token_ids"])
            ids.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert seen == {i: [fake.tokenizer.encode(prompts[i // 2])] for i in range(4)}  # on its first chunk alone
    assert ids == {ch.index: ch.model_dump()["token_ids"] for ch in whole.choices}


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
    ({"prompt": "x", "logit_bias": {"5": 101.0}}, "logit_bias"),  # OpenAI's range: [-100, 100]
    ({"prompt": "x", "logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"50001": 1.0}}, "logit_bias"),  # the fake's vocabulary: ids below 50,001
    ({"prompt": "x", "stop_token_ids": [50_001]}, "stop_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [1, 99_999]}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    # vLLM's checks of prompt logprobs; their values come with the result, so not on a stream
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
])
def test_bad_inputs_answer_400_with_the_reason_before_any_worker_step(stack, body, param):
    r = stack["r"]
    before = _lane_heads(r)
    resp = httpx.post(stack["gw"].base_url + "/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["message"] and (err["param"] or "").startswith(param.split("_")[0]), err
    assert _lane_heads(r) == before


@pytest.mark.parametrize("body, param", [
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [7, 50_001]}, "stop_token_ids"),
    ({"logit_bias": {"50001": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
])
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_bad_stop_token_ids_and_logit_bias_are_a_400_naming_the_field_before_anything_is_queued(stack, path, body, param):
    """Issue 24: negative or out-of-vocabulary ``stop_token_ids``, ``logit_bias`` keys outside the vocabulary and
    values outside OpenAI's [-100, 100], on both endpoints: a 400 whose message and ``param`` name the field, and
    the model's lanes as they were (no job queued)."""
    r = stack["r"]
    before = _lane_heads(r)
    prompt = {"prompt": "x"} if path == "/completions" else {"messages": [{"role": "user", "content": "x"}]}
    resp = httpx.post(stack["gw"].base_url + path, json={"model": MODEL, "max_tokens": 2, **prompt, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert _lane_heads(r) == before


def test_a_chat_stream_with_return_token_ids_carries_the_prompts_ids_once(stack):
    c, fake = stack["client"], FakeEngine()
    messages = [{"role": "user", "content": "the ids of this chat"}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, seed=2, n=2,
                                      extra_body={"return_token_ids": True})
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, seed=2, n=2, stream=True,
                                            extra_body={"return_token_ids": True}))
    carried = [ch.model_dump()["prompt_token_ids"] for ch in chunks if ch.model_dump().get("prompt_token_ids")]
    assert carried == [fake.tokenizer.apply_chat_template(messages, tokenize=True)]  # vLLM's: once in the stream
    assert carried[0] == whole.model_dump()["prompt_token_ids"]


@pytest.mark.parametrize("path, body", [
    ("/chat/completions", {"messages": [{"role": "user", "content": "a b c"}], "truncate_prompt_tokens": 0}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "a b c"}], "truncate_prompt_tokens": 2049}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "a b c"}], "truncate_prompt_tokens": -2}),
    ("/completions", {"prompt": "a b c", "truncate_prompt_tokens": 0}),
    ("/completions", {"prompt": "a b c", "truncate_prompt_tokens": 2049}),
    ("/completions", {"prompt": [1, 2, 3], "truncate_prompt_tokens": 2049}),
    ("/completions", {"prompt": "a b c", "truncate_prompt_tokens": 2, "truncation_side": "middle"}),
])
def test_a_truncation_vllm_refuses_is_a_400_naming_it_before_anything_is_queued(stack, path, body):
    """0 (no prompt left), below -1, past the model's context (2048: vLLM's sentence), an unknown side."""
    r = stack["r"]
    before = _lane_heads(r)
    resp = httpx.post(stack["gw"].base_url + path, timeout=60, json={"model": MODEL, "max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] in ("truncate_prompt_tokens", "truncation_side"), err
    if body["truncate_prompt_tokens"] == 2049:
        assert "truncate_prompt_tokens value (2049) is greater than max_model_len (2048)" in err["message"], err
    assert _lane_heads(r) == before


def test_a_prompt_past_the_context_is_a_400_before_anything_is_queued(stack):
    c, r = stack["client"], stack["r"]
    before, lanes = set(r.scan_iter(match="ps:job:*")), _lane_heads(r)
    too_long = " ".join(f"w{i}" for i in range(1900))  # with max_tokens 1000 past the 2048 context
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=MODEL, prompt=["a short one", too_long, "another short one"], max_tokens=1000)
    assert "This model's maximum context length is 2048 tokens" in info.value.body["message"], info.value.body
    assert info.value.body["param"] == "prompt" and info.value.body["code"] == "invalid_input"
    with pytest.raises(openai.BadRequestError) as info:  # chat: the template counted by the worker's tokenizer
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": too_long}], max_tokens=1000)
    assert "in the messages" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):  # token ids: counted by the gateway itself
        c.completions.create(model=MODEL, prompt=[7] * 2000, max_tokens=100)
    assert set(r.scan_iter(match="ps:job:*")) == before and _lane_heads(r) == lanes
    ok = c.completions.create(model=MODEL, prompt=too_long, max_tokens=20)  # it fits with fewer new tokens
    assert ok.choices[0].finish_reason == "length"


def test_a_prompt_the_engine_refuses_fails_as_invalid_input_without_a_dead_letter(stack):
    """Past the gateway (a producer submitting directly), the engine's refusal at admission is the
    request's fault: a failed result saying why, coded ``invalid_input`` (a gateway answers it 400), no DLQ copy."""
    r = stack["r"]
    dead = r.xlen(keys.dead_letter_stream())
    producer = Producer(r)
    job = producer.submit(prompt=" ".join(f"w{i}" for i in range(1900)), max_tokens=1000, model=MODEL)
    res = producer.result(job, timeout=30)
    assert res.status == JobStatus.FAILED and res.error_code == ErrorCode.INVALID_INPUT, res
    assert "maximum context length" in res.error
    assert r.xlen(keys.dead_letter_stream()) == dead


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


def test_echo_with_logprobs_leads_with_the_prompts_tokens_and_prompt_logprobs_come_in_vllms_shape(stack):
    c, fake = stack["client"], FakeEngine()
    prompt = "score these four words"
    ids = fake.tokenizer.encode(prompt)
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, seed=5, echo=True, logprobs=1)
    ch = out.choices[0]
    assert ch.text == prompt + fake.expected_text(prompt, 5, 2)
    lp = ch.logprobs
    want_prompt = fake.expected_prompt_logprobs(ids, 1)
    assert lp.tokens[:4] == [f"<{i}>" for i in ids] and len(lp.tokens) == 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:4] == [want_prompt[j][ids[j]] for j in range(1, 4)]
    assert lp.token_logprobs[4:] == [d[t] for d, t in zip(fake.expected_logprobs(prompt, 5, 2, 1),
                                                         [int(x.strip("<>")) for x in lp.tokens[4:]])]
    assert all(len(top) == 2 for top in lp.top_logprobs[1:4])  # the prompt's token and the most likely one
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(6)]
    assert ch.model_extra["prompt_logprobs"][0] is None  # what vLLM computed for the echo, reported too

    # lm-evaluation-harness's loglikelihood: token-id prompts, echo, max_tokens=0 (or 1), logprobs=1
    only = c.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert [ch.text for ch in only.choices] == ["".join(f"<{i}>" for i in ids), "".join(f"<{i}>" for i in ids[:2])]
    assert only.choices[0].logprobs.token_logprobs == [None, *(want_prompt[j][ids[j]] for j in range(1, 4))]
    assert len(only.choices[1].logprobs.tokens) == 2
    plain_echo = c.completions.create(model=MODEL, prompt=[ids], max_tokens=1, echo=True, seed=5)
    assert plain_echo.choices[0].text.startswith("".join(f"<{i}>" for i in ids)) and plain_echo.choices[0].logprobs is None
    assert "prompt_logprobs" not in (plain_echo.choices[0].model_extra or {})

    # vLLM's prompt_logprobs extension: per choice on completions, on the response on chat
    body = httpx.post(stack["gw"].base_url + "/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}).json()
    pl = body["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    assert pl[1][str(ids[1])] == {"logprob": want_prompt[1][ids[1]], "rank": None, "decoded_token": f"<{ids[1]}>"}
    assert len(pl[1]) == 3 and sorted(v["rank"] for k, v in pl[1].items() if k != str(ids[1])) == [1, 2]
    assert body["choices"][0]["logprobs"] is None
    chat = httpx.post(stack["gw"].base_url + "/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1,
                            "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(d) == 1 for d in chat["prompt_logprobs"][1:])


def _joined_stream(chunks) -> dict[int, dict]:
    """Each choice of a completions stream put back together: its text, logprobs' lists, finish reason."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            c = out.setdefault(ch.index, {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
                                          "text_offset": [], "finish_reason": None, "first": ch})
            c["text"] += ch.text
            if ch.logprobs is not None:
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    c[k] += getattr(ch.logprobs, k)
            c["finish_reason"] = ch.finish_reason or c["finish_reason"]
    return out


@pytest.mark.parametrize("kwargs", [
    dict(prompt="score these four words", max_tokens=3, logprobs=1, n=2, seed=5),  # text: offsets count the prompt
    dict(prompt=[[11, 12, 13, 14], [15, 16]], max_tokens=0, logprobs=1, temperature=0),  # lm-eval's loglikelihood
    dict(prompt=[[11, 12, 13]], max_tokens=2, seed=5),  # token ids without logprobs: the text the worker named
    dict(prompt="no logprobs asked", max_tokens=2, seed=5),
], ids=["text-n2", "token-ids-max0", "token-ids", "text"])
def test_a_streamed_echo_adds_up_to_the_answer_not_streamed(stack, kwargs):
    """vLLM streams ``echo`` (with or without ``logprobs``, ``max_tokens=0`` too): each choice's first chunk leads
    with the prompt and, with logprobs, its tokens' (the first None); the stream adds up to the whole answer."""
    c, fake = stack["client"], FakeEngine()
    whole = c.completions.create(model=MODEL, echo=True, **kwargs)
    chunks = list(c.completions.create(model=MODEL, echo=True, stream=True, **kwargs))
    got = _joined_stream(chunks)
    prompts = kwargs["prompt"] if isinstance(kwargs["prompt"], list) else [kwargs["prompt"]]
    n = kwargs.get("n", 1)
    assert sorted(got) == [ch.index for ch in whole.choices] == list(range(len(prompts) * n))
    for ch in whole.choices:
        g, prompt = got[ch.index], prompts[ch.index // n]
        assert g["text"] == ch.text and g["finish_reason"] == ch.finish_reason
        ids = prompt if isinstance(prompt, list) else fake.tokenizer.encode(prompt)
        echoed = prompt if isinstance(prompt, str) else "".join(f"<{i}>" for i in ids)  # the fake names token i <i>
        first = g["first"]  # the prompt leads the choice's first chunk, whole
        assert first.text.startswith(echoed) and ch.text.startswith(echoed)
        if kwargs.get("logprobs") is None:
            assert ch.logprobs is None and g["tokens"] == [] and first.logprobs is None
            continue
        lp = ch.logprobs
        assert (g["tokens"], g["token_logprobs"], g["top_logprobs"], g["text_offset"]) == (
            lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset)
        assert first.logprobs.tokens[:len(ids)] == [f"<{i}>" for i in ids]
        assert first.logprobs.token_logprobs[0] is None and None not in first.logprobs.token_logprobs[1:]
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
        if kwargs["max_tokens"] == 0:  # the prompt alone: the token the job sampled does not show
            assert ch.text == echoed and lp.tokens == [f"<{i}>" for i in ids] and ch.finish_reason == "length"


def test_the_readmes_field_table_names_every_request_field():
    """Issue 24, acceptance 6: every field the gateway's request models take is in the README's field-by-field
    section (supported, refused or ignored), so a field added to the models without its row fails here."""
    import re

    from pagestream.producer.gateway.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
    from queue_helpers import ROOT

    text = (ROOT / "README.md").read_text()
    section = text[text.index("### The OpenAI and vLLM fields, one by one"):text.index("### Metrics: vLLM's names")]
    named = {w for span in re.findall(r"`([^`]+)`", section) for w in re.findall(r"[A-Za-z_]+", span)}
    for model in (CompletionRequest, ChatCompletionRequest, StreamOptions):
        missing = sorted(f for f in model.model_fields if f not in named)
        assert not missing, f"{model.__name__}: {missing} not in the README's field table"
