"""Greedy parity with HF transformers `generate` (each prompt alone), for every
supported architecture (Llama, Qwen2, Qwen3, Mistral with a window shorter than the
prompts, Gemma 2 with soft-caps and alternating windows, OPT with project_in/out, pre-
and post-LN): concurrently batched, under preemption, chunked prefill, with prefix hits.

Each of our tokens is checked against HF's logits for the same prefix (the prompt and our
tokens before it, in one HF forward pass): it must be HF's argmax, except where HF's own
top-2 logits are closer than 1e-4 and the two implementations may legitimately pick
different tokens (vLLM's check_logprobs_close idea); the test reports how often. Since HF
reads our prefix, every token is compared, also after such a tie, and a sequence that ends
early must end on an end-of-sequence token HF's generation config names.
"""
import pytest
import torch

from pagestream.engine import LLM, SamplingParams

TIE_GAP = 1e-4
MAX_TOKENS = 24

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "pack boxes of liquor and juggle bright lanterns near the old harbor").split()


def varied_prompts(n=18):
    # lengths from 1 word to ~70 tokens, so sequences cross block boundaries at different steps
    return [" ".join(WORDS[(i * 3) % len(WORDS):] + WORDS[: (i * 7) % 40]) or "hi" for i in range(n)]


def shared_prefix_prompts(n=16):
    prefix = " ".join(WORDS * 4)  # ~100 tokens shared by every prompt
    return [f"{prefix} question {i}: what comes after {i * 13}?" for i in range(n)]


class HFReference:
    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.cache = {}
        self.top2_cache = {}  # (prompt, our tokens) -> HF's top-2: the small pool's run repeats the roomy one's

    def greedy(self, prompt):
        """(token ids, per-step gap between HF's top-2 logits) of HF's own greedy ``generate``."""
        if prompt not in self.cache:
            ids = self.tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = self.model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                                          return_dict_in_generate=True, pad_token_id=self.tok.eos_token_id)
            toks = out.sequences[0, ids.shape[1]:].tolist()
            gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
            self.cache[prompt] = (toks, gaps)
        return self.cache[prompt]

    def top2(self, prompt, got):
        """HF's top-2 logits at each of ``got``'s positions, given the prompt and ``got`` before it (one forward)."""
        key = (prompt, tuple(got))
        if key not in self.top2_cache:
            ids = self.tok(prompt).input_ids
            with torch.no_grad():
                logits = self.model(torch.tensor([ids + list(got)])).logits[0]
            self.top2_cache[key] = logits[len(ids) - 1: len(ids) - 1 + len(got)].topk(2)
        return self.top2_cache[key]

    @property
    def eos_ids(self):
        eos = self.model.generation_config.eos_token_id
        return {eos} if isinstance(eos, int) else set(eos or ())


def assert_parity(llm, hf, prompts, report):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    compared = ties = 0
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        assert got and len(got) <= MAX_TOKENS
        top2 = hf.top2(prompt, got)
        tied = False
        for i, tok in enumerate(got):
            want, gap = int(top2.indices[i, 0]), float(top2.values[i, 0] - top2.values[i, 1])
            if tok != want:
                assert gap < TIE_GAP, (f"prompt {prompt[:40]!r}: token {i} is {tok}, HF says {want} "
                                       f"(HF top-2 gap {gap:.2e})\nours {got}")
                tied = True
            else:
                compared += 1
        if len(got) < MAX_TOKENS:  # stopped early: on an end-of-sequence token, as HF's generate would
            assert got[-1] in hf.eos_ids, f"prompt {prompt[:40]!r}: ended after {len(got)} tokens on {got[-1]}"
        assert all(t not in hf.eos_ids for t in got[:-1]), f"prompt {prompt[:40]!r}: went on past an EOS: {got}"
        ties += tied
        assert out.outputs[0].text == hf.tok.decode(got, skip_special_tokens=True)
    report.append((compared, ties))
    # near-ties must be rare: at most one prompt in eight
    assert ties <= len(prompts) // 8, f"{ties} near-tie prompts over {len(prompts)} prompts"
    return outs


MODELS = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_mistral_dir", "tiny_gemma2_dir", "tiny_opt_dir",
          "tiny_opt_post_ln_dir", pytest.param("smollm2_dir", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def hf_refs():
    return {}


@pytest.mark.parametrize("model_fixture", MODELS)
def test_greedy_parity_batched_preempted_and_prefix_cached(model_fixture, request, hf_refs):
    model_dir = request.getfixturevalue(model_fixture)
    hf = hf_refs.setdefault(model_dir, HFReference(model_dir))
    report = []

    # 1. 18 prompts of different lengths, all at once, roomy pool
    prompts = varied_prompts()
    llm = LLM(model_dir, device="cpu", max_num_seqs=32)
    assert_parity(llm, hf, prompts, report)
    assert llm.llm_engine.stats().num_preemptions == 0

    # 2. a pool so small that sequences get preempted and recomputed, plus chunked prefill
    small = LLM(model_dir, device="cpu", num_kv_blocks=12, block_size=16, max_num_seqs=16, max_num_batched_tokens=48)
    assert_parity(small, hf, prompts, report)
    stats = small.llm_engine.stats()
    assert stats.num_preemptions > 0, "the small pool should have forced preemption"
    assert stats.num_free_blocks == stats.num_total_blocks

    # 3. a long shared prefix: later prompts hit the cache and still match HF
    shared = shared_prefix_prompts()
    cached = LLM(model_dir, device="cpu", max_num_seqs=4)
    assert_parity(cached, hf, shared, report)
    stats = cached.llm_engine.stats()
    assert stats.prefix_cache_hits >= 12 * 96, f"expected prefix-cache hits, got {stats.prefix_cache_hits} tokens"

    compared = sum(c for c, _ in report)
    ties = sum(t for _, t in report)
    print(f"\n{model_fixture}: {compared} tokens identical to HF's argmax, {ties} prompts with a near-tie (<{TIE_GAP})")
