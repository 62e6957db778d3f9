"""Tensor parallelism on the CPU: two ranks over gloo (rank 1 a spawned process), the same code
path as NCCL on GPUs (issue 12, acceptance 1).

Greedy ids at TP=2 equal TP=1's and HF's for tiny models whose split differs: Llama with GQA (4
query / 2 KV heads: one KV head per rank); Qwen2 with one KV head (replicated on both ranks, q/k/v
biases split with it) and an odd vocabulary (padded); Gemma 2 (tied embeddings: the vocab-parallel
embedding is the LM head; soft-caps); OPT (biases on the row-parallel layers, learned positions).
A seeded sampled request gives the same text at TP=1 and 2. Bad splits and too-big models are
refused with the numbers; a worker at TP=2 completes queue jobs and exits when a rank dies.
"""
import os
import signal

import pytest

from pagestream.engine import LLM, EngineConfig, SamplingParams
from pagestream.engine.errors import EngineDeadError
from test_engine_parity import HFReference, assert_parity, varied_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def tiny_qwen2_one_kv_dir(tmp_path_factory, smollm2_dir):
    from pagestream.engine.testing import write_tiny_model

    # an odd vocabulary too: rank 1's slice of the embedding and LM head ends in a padding row
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-1kv"), "qwen2", tokenizer_dir=smollm2_dir,
                            num_key_value_heads=1, vocab_size=49153)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


# Gemma 2 and OPT add ~25 s; they run in the full suite (make test), not in make test-fast.
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_one_kv_dir",
                                           pytest.param("tiny_gemma2_dir", marks=pytest.mark.slow),
                                           pytest.param("tiny_opt_dir", marks=pytest.mark.slow)])
def test_tp2_greedy_ids_equal_tp1_and_hf(model_fixture, request):
    model_dir = request.getfixturevalue(model_fixture)
    prompts = varied_prompts(6)
    # A pool small enough to preempt, and chunked prefill: block tables and partial prefills must
    # reach rank 1 as rank 0 laid them out.
    small = dict(device="cpu", num_kv_blocks=12, block_size=16, max_num_seqs=8, max_num_batched_tokens=48)
    want = _ids(LLM(model_dir, **small).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(model_dir, tensor_parallel_size=2, **small)
    try:
        runner = llm.llm_engine.runner
        assert runner.tp.size == 2 and runner.driver.procs[0].is_alive()
        outs = assert_parity(llm, HFReference(model_dir), prompts, [])
        assert _ids(outs) == want
        assert llm.llm_engine.stats().num_preemptions > 0, "the small pool should have forced preemption"
    finally:
        llm.llm_engine.runner.shutdown()


def test_tp2_sampled_text_equals_tp1(tiny_llama_dir):
    prompts = varied_prompts(6)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=20) for i in range(len(prompts))]
    want = [o.outputs[0].text for o in LLM(tiny_llama_dir, device="cpu").generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_llama_dir, device="cpu", tensor_parallel_size=2)
    try:
        got = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.runner.shutdown()
    assert got == want
    assert len(set(got)) == len(got)  # really sampled, not one text


def test_a_dead_rank_stops_the_engine_with_a_clear_error(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", tensor_parallel_size=2, load_format="dummy")
    try:
        assert len(llm.generate(["hello there"], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4
        follower = llm.llm_engine.runner.driver.procs[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(10)
        with pytest.raises(EngineDeadError, match=r"rank 1 of 2 died .*exited with code -9"):
            llm.generate(["hello again"], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.llm_engine.runner.shutdown()


@pytest.mark.parametrize("overrides, tp, message", [
    ({}, 3, r"num_attention_heads \(4\) must be divisible by tensor_parallel_size \(3\)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2,
     r"num_key_value_heads \(3\) and tensor_parallel_size \(2\) must divide one another"),
    ({"intermediate_size": 129}, 2, r"intermediate_size \(129\) must be divisible by tensor_parallel_size \(2\)"),
    ({}, 0, r"tensor_parallel_size must be an int >= 1, got 0"),
])
def test_bad_splits_are_refused_with_the_numbers(tiny_llama_dir, overrides, tp, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=tiny_llama_dir, device="cpu", tensor_parallel_size=tp, hf_overrides=overrides)


def test_one_kv_head_is_replicated_on_every_rank(tiny_llama_dir):
    # 4 query heads, 2 KV heads at TP=4: each KV head on two ranks (config accepted)
    EngineConfig(model=tiny_llama_dir, device="cpu", tensor_parallel_size=4)


# Llama-3-70B's layer shape. The real 80 layers are ~0.94 of an H200's memory (refused at TP=1 only
# by the gpu_memory_utilization margin); with 120 layers the weights are ~1.4 cards: no doubt at TP=1,
# ~0.7 of a card per rank at TP=2. bench/gpu_tp.py runs this shape on two H200s.
LLAMA_70B_SHAPED_120 = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=8192,
    intermediate_size=28672, num_hidden_layers=120, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
)


def test_a_model_too_big_for_one_gpu_is_refused_with_its_size():
    import torch

    from pagestream.engine.memory import GiB, check_weights_fit, weight_bytes_per_gpu

    h200 = 143771 * 2**20
    one = weight_bytes_per_gpu(LLAMA_70B_SHAPED_120, torch.bfloat16, 1)
    two = weight_bytes_per_gpu(LLAMA_70B_SHAPED_120, torch.bfloat16, 2)
    layer = 2 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192)  # q, o, k, v, MLP, 2 norms
    assert one == 120 * layer + 2 * (2 * 128256 * 8192 + 8192)  # + embedding, LM head, final norm
    assert 1.3 * h200 < one < 1.5 * h200
    assert two == one // 2 + (120 * 2 + 1) * 8192  # everything splits but the (replicated) norms
    with pytest.raises(ValueError, match=rf"weights need {one / GiB:.1f} GiB per GPU at tensor_parallel_size=1 .*"
                                         rf"at tensor_parallel_size=2 they take {two / GiB:.1f} GiB per GPU"):
        check_weights_fit(LLAMA_70B_SHAPED_120, torch.bfloat16, 1, h200, 0.9)
    assert check_weights_fit(LLAMA_70B_SHAPED_120, torch.bfloat16, 2, h200, 0.9) == two


def _spawned_rank(pid: int) -> int:
    """The pid of the tensor-parallel rank a process spawned (not multiprocessing's resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(k) for k in f.read().split()]
    for kid in kids:
        with open(f"/proc/{kid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return kid
    raise AssertionError(f"no spawned rank among {kids}")


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [False, True], ids=["in-worker", "engine-process"])
def test_worker_at_tp2_completes_queue_jobs_and_exits_when_a_rank_dies(redis_url, producer, tiny_llama_dir, tmp_path,
                                                                       engine_process):
    from pagestream.producer import JobStatus
    from tests.queue_helpers import WorkerProc, engine_core_pid, wait_for

    prompts = varied_prompts(5)
    want = [o.outputs[0].text for o in LLM(tiny_llama_dir, device="cpu").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)]
    # with --engine-process (the default on CUDA) rank 0 is the worker's engine core, rank 1 its child
    w = WorkerProc(redis_url, tiny_llama_dir, "tp2-w", "--tensor-parallel-size", "2", "--max-num-seqs", "8",
                   "--engine-process" if engine_process else "--no-engine-process", log_dir=tmp_path)
    try:
        w.wait_ready()
        ids = [producer.submit(prompt=p, max_tokens=12, temperature=0.0) for p in prompts]
        for job_id, text in zip(ids, want):
            res = producer.result(job_id, timeout=60)
            assert res.status == JobStatus.COMPLETED and res.text == text
        os.kill(_spawned_rank(engine_core_pid(w) if engine_process else w.proc.pid), signal.SIGKILL)
        late = producer.submit(prompt="one more", max_tokens=12)
        wait_for(lambda: w.proc.poll() is not None, 60, "the worker to exit after its rank died")
        assert w.proc.returncode != 0
        assert "rank 1 of 2 died" in w.log()
        # the job it could not run was handed back for another worker, not failed
        assert producer.status(late) != JobStatus.FAILED
    finally:
        w.stop()
