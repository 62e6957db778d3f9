"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``) equal HF transformers' log-softmax of the
prompt (fp32 on the CPU, within 1e-4): in one prefill, across chunked prefill, with a prefix of the
prompt already in the cache (a request asking for them computes its prompt anyway), in process
(``LLM`` / ``LLMEngine``) and through ``EngineProcess``."""
import pytest
import torch

from pagestream.engine import LLM, SamplingParams
from pagestream.engine.config import EngineConfig

TOL = 1e-4
K = 3
PROMPTS = [
    "The quick brown fox jumps over the lazy dog while seven wizards quietly pack boxes of liquor",
    "Paris is the capital of",
    "hi",
    " ".join(["one two three four five six seven eight nine ten"] * 5),
]


@pytest.fixture(scope="module")
def hf_ref(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def ref(ids: list[int]) -> torch.Tensor:  # [len(ids) - 1, vocab]: row j scores token j + 1
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)[:-1]

    return ref


def check(out, ref, k=K):
    ids = out.prompt_token_ids
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids)
    assert lps[0] is None
    want = ref(ids)
    for j in range(1, len(ids)):
        d = lps[j]
        assert ids[j] in d
        assert abs(d[ids[j]] - float(want[j - 1, ids[j]])) < TOL, (j, d[ids[j]], float(want[j - 1, ids[j]]))
        top = want[j - 1].topk(k)
        top_ids = set(top.indices.tolist())
        assert set(d) == top_ids | {ids[j]}
        for t, v in d.items():
            assert abs(v - float(want[j - 1, t])) < TOL


def test_prompt_rows_are_the_positions_before_each_scored_prompt_token():
    import numpy as np

    from pagestream.engine.prompt_logprobs import prompt_chunks
    from pagestream.engine.sequence import Sequence

    def seq(name, n_prompt, computed, k, index=0, out=0):
        s = Sequence(name, name, index, list(range(100, 100 + n_prompt + out)), n_prompt,
                     SamplingParams(prompt_logprobs=k), 0)
        s.num_computed_tokens = computed
        return s

    a = seq("a", 10, 0, 2)  # first chunk of 4: rows 0..3 score prompt tokens 1..4
    b = SamplingParams()  # a decode row that does not ask
    plain = Sequence("p", "p", 0, [1, 2, 3], 2, b, 0)
    plain.num_computed_tokens = 2
    c = seq("c", 6, 4, 0)  # last chunk [4, 6): row 4 scores token 5; row 5 (the last prompt position) none
    d = seq("d", 6, 0, 1, index=1)  # a second sample: its first sample reports them
    e = seq("e", 5, 5, 1, out=1)  # decoding after its prompt: nothing
    chunks, rows = prompt_chunks({a: 4, plain: 1, c: 2, d: 6, e: 1}, np.array([0, 4, 5, 7, 13, 14]))
    assert [(ch.seq.seq_id, ch.first, ch.targets, ch.k) for ch in chunks] == [
        ("a", 1, [101, 102, 103, 104], 2), ("c", 5, [105], 0)]
    assert rows.tolist() == [0, 1, 2, 3, 5]


def _llm(model_dir, **kw):
    cfg = dict(model=model_dir, device="cpu", max_model_len=512, block_size=16)
    cfg.update(kw)
    return LLM(**cfg)


def test_prompt_logprobs_match_hf(tiny_llama_dir, hf_ref, monkeypatch):
    monkeypatch.setattr("pagestream.engine.prompt_logprobs._ROWS_PER_SLICE", 7)  # long chunks go in slices
    llm = _llm(tiny_llama_dir)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K), use_tqdm=False)
    for out in outs:
        check(out, hf_ref)
    # requests that do not ask get none, in the same batch
    mixed = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2, prompt_logprobs=0), SamplingParams(max_tokens=2)],
                         use_tqdm=False)
    check(mixed[0], hf_ref, k=0)
    assert mixed[1].prompt_logprobs is None


def test_prompt_logprobs_across_chunked_prefill(tiny_llama_dir, hf_ref):
    # a 16-token budget: the long prompts are prefilled over several steps, beside each other
    llm = _llm(tiny_llama_dir, max_num_batched_tokens=16, max_num_seqs=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=K), use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) > 40
    for out in outs:
        check(out, hf_ref)


def test_prompt_logprobs_with_a_cached_prefix(tiny_llama_dir, hf_ref):
    llm = _llm(tiny_llama_dir, enable_prefix_caching=True)
    prefix = PROMPTS[3]
    llm.generate([prefix + " and more"], SamplingParams(max_tokens=2), use_tqdm=False)  # fills the cache
    hits = llm.llm_engine.block_manager.prefix_cache_hits
    again = llm.generate([prefix + " and more"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.llm_engine.block_manager.prefix_cache_hits > hits  # the prefix is there to hit
    out = llm.generate([prefix + " and more"], SamplingParams(max_tokens=2, prompt_logprobs=K), use_tqdm=False)[0]
    check(out, hf_ref)
    assert out.prompt_token_ids == again[0].prompt_token_ids


def test_prompt_logprobs_n_samples_and_delta_outputs(tiny_llama_dir, hf_ref):
    from pagestream.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, device="cpu", max_model_len=512, max_num_batched_tokens=16))
    engine.add_request("a", prompt=PROMPTS[0], params=SamplingParams(n=2, max_tokens=3, prompt_logprobs=K, seed=1))
    got = []
    while engine.has_unfinished_requests():
        got += [o for o in engine.step() if o.request_id == "a"]
    with_lps = [o for o in got if o.prompt_logprobs is not None]
    assert len(with_lps) == 1 and with_lps[0] is got[0]  # once, in the first output
    check(with_lps[0], hf_ref)


def test_prompt_logprobs_through_engine_process(tiny_llama_dir, hf_ref):
    from pagestream.engine.engine_process import EngineProcess

    with EngineProcess(EngineConfig(model=tiny_llama_dir, device="cpu", max_model_len=512,
                                    max_num_batched_tokens=16)) as proc:
        proc.add_request("a", prompt=PROMPTS[0], params=SamplingParams(max_tokens=3, prompt_logprobs=K))
        proc.add_request("b", prompt=PROMPTS[1], params=SamplingParams(max_tokens=3, prompt_logprobs=K,
                                                                        output_kind="final"))
        proc.add_request("c", prompt=PROMPTS[1], params=SamplingParams(max_tokens=3))
        got: dict[str, list] = {}
        while proc.has_unfinished_requests():
            for o in proc.step(timeout_s=0.5):
                got.setdefault(o.request_id, []).append(o)
    a = [o for o in got["a"] if o.prompt_logprobs is not None]
    assert len(a) == 1
    check(a[0], hf_ref)
    assert len(got["b"]) == 1
    check(got["b"][0], hf_ref)
    assert all(o.prompt_logprobs is None for o in got["c"])
