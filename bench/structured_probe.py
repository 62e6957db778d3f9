"""Why a constrained output fails json.loads on the GPU (issue 23; found: the synthetic tokenizer does not
mark the config's EOS ids special, so the EOS word was in the text; it is dropped here now): for each output that finished
"stop" but does not parse, replay its token ids through a fresh xgrammar matcher. Rejected ids mean
the mask let a forbidden token through (an engine bug); all accepted means the text decoded from
accepted tokens is not what the grammar saw (the tokenizer's decode against xgrammar's token strings).

    . bench/device_env.sh && python3 bench/structured_probe.py [--enforce-eager] [--num-prompts 64]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured import SCHEMA, SHAPES, model_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagestream.engine import LLM, SamplingParams, StructuredOutputsParams

    device = torch.device(args.device)
    path = model_dir(args.shape, device)
    vocab = SHAPES[args.shape]["vocab_size"]
    llm = LLM(model=path, device=device.type, dtype="bfloat16" if device.type == "cuda" else "float32", max_model_len=2048,
              max_num_seqs=max(args.num_prompts, 8), gpu_memory_utilization=0.6, enforce_eager=args.enforce_eager)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=args.temperature, max_tokens=256, seed=0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(path)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)).compile_json_schema(json.dumps(SCHEMA))
    summary = {"eager": args.enforce_eager, "n": len(outs), "stop": 0, "parse": 0, "rejected": 0, "accepted_not_parse": 0}
    shown = 0
    for o in outs:
        c = o.outputs[0]
        summary["stop"] += c.finish_reason == "stop"
        ids = [t for t in c.token_ids if t not in llm.llm_engine.eos_token_ids]
        try:
            json.loads(tok.decode(ids).replace("▁", " "))
            summary["parse"] += 1
            continue
        except ValueError:
            pass
        m = xgr.GrammarMatcher(compiled)
        bad = next((i for i, t in enumerate(c.token_ids) if not m.accept_token(t)), None)
        summary["rejected" if bad is not None else "accepted_not_parse"] += 1
        if shown < 3:
            shown += 1
            print("FAIL", c.finish_reason, "first rejected at", bad, "of", len(c.token_ids),
                  repr(c.text[:160]), [tok.convert_ids_to_tokens(t) for t in c.token_ids[max(0, (bad or 0) - 3):(bad or 0) + 2]])
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
