"""Structured outputs on the H200 (issue 23, acceptance 5), one call, side by side:

    . bench/device_env.sh && python3 bench/structured.py --out $OUT
    python3 bench/structured.py --device cpu --shape tiny --num-prompts 8 --out-len 32   # logic check on a CPU

Llama-3.2-1B shape, random-init bf16 weights, 256 concurrent requests x 128 prompt tokens -> up to
--out-len tokens, in this order: unconstrained (EOS ignored); the same requests under one JSON schema
(asynchronous scheduling on, as the engine runs them); the same again with every step synchronous
(what the engine did before: a constrained request turned async scheduling off); like for like, the
unconstrained requests with each one's max_tokens set to its constrained output's length (EOS
ignored: the same token counts, so the ratio compares the same work); unconstrained again. Reports
tok/s of each and the ratios, the host time the mask adds per masked step (the engine's
_grammar_rows, timed without its wait for the step in flight, reported apart), and the
first-request latency a new schema's compile adds, and a cached one's. The tokenizer is synthetic (the machine has no network): the ASCII characters as
single tokens plus space-prefixed words up to the model's vocab_size, so JSON is expressible.
xgrammar must be importable on the device (carry its wheel in .whl with apache-tvm-ffi).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_engine import SHAPES, write_model  # noqa: E402
from throughput import write_tokenizer  # noqa: E402

SHAPES = {**SHAPES, "tiny": dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                                 rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)}
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
    "kind": {"enum": ["alpha", "beta", "gamma"]},
    "items": {"type": "array", "minItems": 1, "maxItems": 200, "items": {"type": "string", "maxLength": 12}}},
    "required": ["id", "kind", "items"], "additionalProperties": False}


def log(*a):
    print(*a, flush=True)


def model_dir(shape: str, device) -> str:
    """The shape's random-init model with a tokenizer holding the ASCII characters (made once per machine)."""
    path = f"/tmp/pagestream-structured-{shape}"
    if not os.path.exists(os.path.join(path, "config.json")):
        write_model(shape, path, device, SHAPES)
        write_tokenizer(path, SHAPES[shape]["vocab_size"], chars="".join(map(chr, range(32, 127))))
    return path


def _constrained(seqs) -> bool:
    for s in seqs:
        if s.params.structured_outputs is not None:
            return True
    return False


def run(llm, prompts, params, *, async_scheduling: bool = True) -> dict:
    """One timed ``generate``; with a constraint, the mask's host time per masked step (the engine's
    _grammar_rows, without the wait for the step in flight: that wait overlaps the forward pass and
    is reported apart). ``async_scheduling=False`` runs every step synchronously (the tree before
    issue 23's async structured steps did that whenever a constrained request ran)."""
    engine = llm.llm_engine.core
    runner = engine.runner
    structured = any(p.structured_outputs is not None for p in (params if isinstance(params, list) else [params]))
    if structured:
        engine.structured_outputs  # the manager (and the runner's hook) before the clock starts
    real = runner.grammar_rows
    mask_s, wait_s, masked = [0.0], [0.0], [0]

    def timed(seqs, prev=None):
        if prev is not None and _constrained(seqs):
            t0 = time.perf_counter()
            prev.result()  # what _grammar_rows waits for first (memoized: it does not wait again)
            wait_s[0] += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = real(seqs, prev)
        mask_s[0] += time.perf_counter() - t0
        masked[0] += out is not None
        return out

    if real is not None:
        runner.grammar_rows = timed
    was_async = engine.config.async_scheduling
    engine.config.async_scheduling = async_scheduling
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    dt = time.perf_counter() - t0
    engine.config.async_scheduling = was_async
    runner.grammar_rows = real
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    res = {"s": dt, "output_tokens": tokens, "tok_per_s": tokens / dt, "async_scheduling": async_scheduling,
           "masked_steps": masked[0], "mask_host_ms_total": 1e3 * mask_s[0],
           "mask_host_ms_per_masked_step": 1e3 * mask_s[0] / masked[0] if masked[0] else None,
           "wait_for_step_in_flight_ms_total": 1e3 * wait_s[0]}
    res["output_lens"] = [len(o.outputs[0].token_ids) for o in outs]
    res["token_ids"] = [o.outputs[0].token_ids for o in outs]
    if structured:
        valid = 0
        eos = engine.eos_token_ids
        for o in outs:
            # the text without the EOS that ended it: this synthetic tokenizer does not mark the config's
            # EOS ids (Llama's 128001, 128008, 128009) as special, so their words are not skipped in the text
            ids = [t for t in o.outputs[0].token_ids if t not in eos]
            try:
                json.loads(engine.tokenizer.decode(ids).replace("▁", " "))
                valid += o.outputs[0].finish_reason == "stop"
            except ValueError:
                pass
        res["finished_valid_json"] = valid
        res["finish_reasons"] = {r: sum(o.outputs[0].finish_reason == r for o in outs) for r in ("stop", "length")}
    return res


def _brief(res: dict) -> dict:
    return {k: v for k, v in res.items() if k not in ("output_lens", "token_ids")}


def compile_latency(llm, prompt) -> dict:
    from pagestream.engine import SamplingParams, StructuredOutputsParams

    out = {}
    for label, schema in (("new", {**SCHEMA, "title": f"fresh-{time.time()}"}), ("cached", SCHEMA)):
        p = SamplingParams(max_tokens=1, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=p, use_tqdm=False)
        out[f"{label}_schema_first_token_ms"] = 1e3 * (time.perf_counter() - t0)
    p = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=[prompt], sampling_params=p, use_tqdm=False)
    out["unconstrained_first_token_ms"] = 1e3 * (time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--in-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from pagestream.engine import LLM, SamplingParams, StructuredOutputsParams

    device = torch.device(args.device)
    path = model_dir(args.shape, device)
    llm = LLM(model=path, device=device.type, dtype="bfloat16" if device.type == "cuda" else "float32",
              max_model_len=2048, max_num_seqs=max(args.num_prompts, 8), gpu_memory_utilization=0.85)
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [[rng.randrange(100, vocab) for _ in range(args.in_len)] for _ in range(args.num_prompts)]
    plain = SamplingParams(temperature=1.0, max_tokens=args.out_len, ignore_eos=True, seed=0)
    constrained = SamplingParams(temperature=1.0, max_tokens=args.out_len, seed=0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    run(llm, prompts[:8], plain)  # warm-up: shapes, the grammar's compile
    run(llm, prompts[:8], constrained)
    run(llm, prompts[:8], constrained, async_scheduling=False)
    res = {"shape": args.shape, "device": str(device), "num_prompts": args.num_prompts, "in_len": args.in_len,
           "out_len": args.out_len, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}
    runs = {}
    runs["unconstrained"] = run(llm, prompts, plain)
    runs["json_schema"] = run(llm, prompts, constrained)
    # the same requests with every step synchronous: what the engine did before (a constrained request
    # turned asynchronous scheduling off for the whole batch)
    runs["json_schema_sync"] = run(llm, prompts, constrained, async_scheduling=False)
    # like for like: unconstrained, each request making exactly as many tokens as its constrained run did
    lens = runs["json_schema"]["output_lens"]
    runs["unconstrained_same_lens"] = run(llm, prompts, [
        SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=0) for n in lens])
    runs["unconstrained_again"] = run(llm, prompts, plain)
    for name, r in runs.items():
        log(name, _brief(r))
        res[name] = _brief(r)
    res["ratio_tok_per_s"] = runs["json_schema"]["tok_per_s"] / runs["unconstrained"]["tok_per_s"]
    res["ratio_tok_per_s_same_lens"] = runs["json_schema"]["tok_per_s"] / runs["unconstrained_same_lens"]["tok_per_s"]
    res["ratio_tok_per_s_sync"] = runs["json_schema_sync"]["tok_per_s"] / runs["unconstrained"]["tok_per_s"]
    res["ratio_tok_per_s_sync_same_lens"] = (runs["json_schema_sync"]["tok_per_s"]
                                             / runs["unconstrained_same_lens"]["tok_per_s"])
    res["unconstrained_repeat_ratio"] = runs["unconstrained_again"]["tok_per_s"] / runs["unconstrained"]["tok_per_s"]
    res["same_lens_output_tokens_equal"] = runs["unconstrained_same_lens"]["output_tokens"] == runs["json_schema"]["output_tokens"]
    res["json_output_lens"] = lens
    # seeded, so async and sync should sample alike; on a GPU a different batch make-up can move bf16 logits
    res["json_async_sync_identical_requests"] = sum(
        a == b for a, b in zip(runs["json_schema"]["token_ids"], runs["json_schema_sync"]["token_ids"]))
    res["compile"] = compile_latency(llm, prompts[0])
    res["stats"] = {k: getattr(llm.llm_engine.stats(), k) for k in ("structured_compilations", "structured_cache_hits")}
    log(json.dumps({k: v for k, v in res.items() if k != "json_output_lens"}, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "structured.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
