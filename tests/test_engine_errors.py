"""Bad input raises ValueError naming the problem and the allowed range; the engine keeps serving."""
import pytest

from pagestream.engine import LLM, EngineConfig, SamplingParams


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(n=0), "n must be an integer >= 1"),
        (dict(top_k=-5), "top_k must be -1"),
        (dict(min_p=2.0), "min_p must be in [0, 1]"),
        (dict(logprobs=50), "logprobs must be in [0, 20]"),
    ],
)
def test_invalid_sampling_params_name_the_allowed_range(kwargs, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert words in str(err.value)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown model .*no-such-model.*config.json"):
        LLM(str(tmp_path / "no-such-model"))


def test_config_limits_are_checked(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 1024\]"):
        EngineConfig(model=tiny_llama_dir, max_model_len=5000)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig(model=tiny_llama_dir, block_size=12)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(model=tiny_llama_dir, gpu_memory_utilization=1.5)


def test_bad_requests_are_refused_and_the_engine_keeps_serving(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", max_model_len=64, num_kv_blocks=64)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("good-1", prompt="a perfectly fine prompt", params=params)
    tokens, reasons = {}, {}
    while not tokens:  # outputs come one step after their forward pass (asynchronous scheduling)
        tokens = {o.request_id: list(o.outputs[0].token_ids) for o in engine.step()}
    assert list(tokens) == ["good-1"]

    with pytest.raises(ValueError, match=r"prompt has \d+ tokens but max_model_len is 64: a prompt may have at most 63"):
        engine.add_request("too-long", prompt="word " * 200, params=params)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", prompt="", params=params)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty-ids", prompt_token_ids=[], params=params)
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 49152\)"):
        engine.add_request("bad-ids", prompt_token_ids=[1, 2, 10**9], params=params)
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("good-1", prompt="again", params=params)
    with pytest.raises(ValueError, match="needs a prompt"):
        engine.add_request("nothing", params=params)
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        engine.add_chat_request("chat", messages=[], params=params)

    engine.add_request("good-2", prompt="another fine prompt", params=params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                reasons[out.request_id] = out.outputs[0].finish_reason
    assert reasons == {"good-1": "length", "good-2": "length"}
    assert {rid: len(t) for rid, t in tokens.items()} == {"good-1": 8, "good-2": 8}
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_prompt_larger_than_the_whole_kv_pool_is_refused(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="needs 3 KV blocks but the whole pool has 2"):
        llm.generate(["x " * 40], SamplingParams(max_tokens=4), use_tqdm=False)
    out = llm.generate(["short"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_abort_frees_blocks_and_reports_abort(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=32)
    engine = llm.llm_engine
    engine.add_request("long", prompt="count with me " * 5, params=SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().num_free_blocks < 32
    assert engine.abort_request("long")
    outs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [("long", True, "abort")]
    assert engine.stats().num_free_blocks == 32
    assert not engine.has_unfinished_requests()


def test_a_bad_prompt_fails_generate_whole_and_the_next_call_is_clean(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate(["fine", "also fine", "word " * 200], params, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    outs = llm.generate(["fine"], params, use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 4
