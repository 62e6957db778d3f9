"""Structured outputs on the H200 (issue 23, acceptance 5), one call, side by side:

    . bench/device_env.sh && python3 bench/structured.py --out $OUT
    python3 bench/structured.py --device cpu --shape tiny --num-prompts 8 --out-len 32   # logic check on a CPU

Llama-3.2-1B shape, random-init bf16 weights, 256 concurrent requests x 128 prompt tokens -> up to
--out-len tokens: unconstrained (EOS ignored) against the same requests under one JSON schema (an
array of strings long enough to fill the budget, so both runs make about the same tokens). Reports
output tok/s of each and their ratio, the host time the mask adds per step (filling the bitmask:
the engine's _grammar_rows, timed), and the first-request latency a new schema's compile adds, and
a cached one's. The tokenizer is synthetic (the machine has no network): the ASCII characters as
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


def run(llm, prompts, params) -> dict:
    engine = llm.llm_engine
    mask_s = [0.0, 0]
    real = engine._grammar_rows

    def timed(seqs):
        t0 = time.perf_counter()
        out = real(seqs)
        mask_s[0] += time.perf_counter() - t0
        mask_s[1] += out is not None
        return out

    engine._grammar_rows = timed
    if engine._structured is not None:
        engine.runner.sampler.grammar_rows = timed
    if params.structured_outputs is not None:
        engine.structured_outputs  # the manager (and the sampler's hook) before the clock starts
        engine.runner.sampler.grammar_rows = timed
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    dt = time.perf_counter() - t0
    engine._grammar_rows = real
    if engine._structured is not None:
        engine.runner.sampler.grammar_rows = real
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    res = {"s": dt, "output_tokens": tokens, "tok_per_s": tokens / dt,
           "masked_steps": mask_s[1], "mask_host_ms_total": 1e3 * mask_s[0],
           "mask_host_ms_per_masked_step": 1e3 * mask_s[0] / mask_s[1] if mask_s[1] else None}
    if params.structured_outputs is not None:
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
    res = {"shape": args.shape, "device": str(device), "num_prompts": args.num_prompts, "in_len": args.in_len,
           "out_len": args.out_len}
    res["unconstrained"] = run(llm, prompts, plain)
    log("unconstrained", res["unconstrained"])
    res["json_schema"] = run(llm, prompts, constrained)
    log("json_schema", res["json_schema"])
    res["unconstrained_again"] = run(llm, prompts, plain)
    log("unconstrained again", res["unconstrained_again"])
    res["ratio_tok_per_s"] = res["json_schema"]["tok_per_s"] / res["unconstrained"]["tok_per_s"]
    res["compile"] = compile_latency(llm, prompts[0])
    res["stats"] = {k: getattr(llm.llm_engine.stats(), k) for k in ("structured_compilations", "structured_cache_hits")}
    log(json.dumps(res, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "structured.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
