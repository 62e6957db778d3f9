"""Asynchronous scheduling changes when the host learns a token, never which token.

Step N+1 is planned while step N runs, with N's tokens still on the device; a sequence
that N ended has N+1's token dropped. Every request a user can make must come out the
same as with each step waited for (``async_scheduling=False``).
"""
import pytest

from pagestream.engine import LLM, SamplingParams

PROMPTS = [f"request {i}: tell me about {'harbors ' * (i % 4)}and lanterns number {i * 7}" for i in range(14)]


def mixed_params():
    """One of each kind of request, cycled over the prompts."""
    return [
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=23, ignore_eos=True),
        SamplingParams(temperature=0.8, n=2, seed=5, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, stop=["e"], max_tokens=40, ignore_eos=True),  # stops after a few tokens
        SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, min_tokens=6, max_tokens=8),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=9, top_k=20, max_tokens=30, ignore_eos=True),
    ]


def run(model_dir, async_scheduling, params, **kw):
    llm = LLM(model_dir, device="cpu", async_scheduling=async_scheduling, **kw)
    outs = llm.generate(PROMPTS, [params[i % len(params)] for i in range(len(PROMPTS))], use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # every block back, dropped tokens included
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs], stats


def assert_same(asyn, sync):
    """Tokens, text and reasons exactly; logprobs to 1e-5: the async plan may batch differently
    (a finished sequence's wasted step takes budget), which moves fp32 sums by an ulp."""
    assert [[c[:4] for c in o] for o in asyn] == [[c[:4] for c in o] for o in sync]
    for o_a, o_s in zip(asyn, sync):
        for c_a, c_s in zip(o_a, o_s):
            assert (c_a[4] is None) == (c_s[4] is None)
            for lp_a, lp_s in zip(c_a[4] or [], c_s[4] or []):
                assert lp_a.keys() == lp_s.keys() and lp_a == pytest.approx(lp_s, abs=1e-5)


@pytest.mark.parametrize("pool", [dict(num_kv_blocks=256), dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=40)],
                         ids=["roomy", "preempting"])
def test_async_outputs_equal_synchronous_ones_for_every_kind_of_request(tiny_llama_dir, pool):
    sync, _ = run(tiny_llama_dir, False, mixed_params(), **pool)
    asyn, stats = run(tiny_llama_dir, True, mixed_params(), **pool)
    assert_same(asyn, sync)
    if "block_size" in pool:
        assert stats.num_preemptions > 0
    assert any(s[0][2] == "stop" and s[0][3] == "e" for s in sync)  # the stop string really ended one early


def test_penalties_and_the_model_length_limit_stay_exact(tiny_llama_dir):
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)]  # ends at max_model_len
    sync, _ = run(tiny_llama_dir, False, params, max_model_len=48)
    asyn, _ = run(tiny_llama_dir, True, params, max_model_len=48)
    assert_same(asyn, sync)
    assert {s[0][2] for s in sync} == {"length"}


def test_a_request_aborted_with_a_step_in_flight_gets_no_more_tokens(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=64)
    engine = llm.llm_engine
    engine.add_request("a", prompt="count with me", params=SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", prompt="and me", params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    seen = {"a": 0, "b": 0}
    while seen["a"] < 3:
        for o in engine.step():
            seen[o.request_id] += len(o.outputs[0].token_ids)
    assert engine.core.step_in_flight  # a step holding a token of "a" is on its way
    assert engine.abort_request("a")
    after = []
    while engine.has_unfinished_requests():
        after += engine.step()
    assert [(o.request_id, o.finished) for o in after if o.request_id == "a"] == [("a", True)]
    assert sum(len(o.outputs[0].token_ids) for o in after if o.request_id == "b") + seen["b"] == 6
    assert engine.stats().num_free_blocks == 64


def test_the_lm_head_on_bucketed_row_counts_changes_no_output(tiny_llama_dir):
    # On CUDA the LM head runs on a bucketed number of rows (each bucket's matmul set up at start-up);
    # the padding rows must never reach a sample. Forced on here, on the CPU.
    from pagestream.engine.model_runner import batch_buckets

    plain, _ = run(tiny_llama_dir, True, mixed_params(), num_kv_blocks=256)
    llm = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=256)
    runner = llm.llm_engine.runner
    runner.sample_buckets = batch_buckets(llm.llm_engine.config.max_num_seqs)
    head_rows, sampled_rows = [], []
    head, sampler = runner.model.compute_logits, runner.sampler
    runner.model.compute_logits = lambda h: (head_rows.append(h.shape[0]), head(h))[1]
    runner.sampler = lambda logits, seqs: (sampled_rows.append((logits.shape[0], len(seqs))), sampler(logits, seqs))[1]
    params = mixed_params()
    outs = llm.generate(PROMPTS, [params[i % len(params)] for i in range(len(PROMPTS))], use_tqdm=False)
    padded = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]
    assert set(head_rows) <= set(runner.sample_buckets)
    assert all(n_logits == n_seqs for n_logits, n_seqs in sampled_rows)  # the sampler sees real rows only
    assert any(n not in runner.sample_buckets for _, n in sampled_rows)  # some step really was padded
    assert_same(padded, plain)
