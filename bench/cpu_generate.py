"""CPU generation throughput: pagestream's engine vs HF transformers `generate`, same
prompts, same process, SmolLM2-135M-Instruct (fp32).

    .venv/bin/python bench/cpu_generate.py [--num-prompts 16] [--max-tokens 128]

Both sides generate exactly --max-tokens tokens per prompt (EOS ignored), greedy.
HF runs the 16 prompts as one left-padded batch (its fastest mode here) and also
one at a time; the engine runs them through continuous batching.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-hf-sequential", action="store_true")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagestream.engine import LLM, SamplingParams
    from pagestream.engine.smollm2 import ensure_smollm2

    model_dir = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(model_dir)
    topics = ["cloud computing", "the water cycle", "black holes", "compilers", "photosynthesis", "the Roman empire",
              "neural networks", "jazz", "volcanoes", "databases", "the immune system", "chess openings",
              "solar panels", "bread baking", "plate tectonics", "encryption"]
    msgs = [[{"role": "user", "content": f"Explain {topics[i % len(topics)]} in a few sentences."}] for i in range(args.num_prompts)]
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    n_gen = args.num_prompts * args.max_tokens
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "threads": torch.get_num_threads(), "num_prompts": args.num_prompts, "max_tokens": args.max_tokens}

    llm = LLM(model_dir, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    assert sum(len(o.outputs[0].token_ids) for o in outs) == n_gen
    result["pagestream_tok_s"] = n_gen / dt
    result["pagestream_s"] = dt

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    gen_kw = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        hf.generate(**tok(prompts[:2], return_tensors="pt", padding=True, add_special_tokens=False), max_new_tokens=4, do_sample=False)
        t = time.perf_counter()
        hf.generate(**batch, **gen_kw)
        dt = time.perf_counter() - t
    result["hf_batched_tok_s"] = n_gen / dt
    result["hf_batched_s"] = dt
    if not args.skip_hf_sequential:
        with torch.no_grad():
            t = time.perf_counter()
            for p in prompts:
                hf.generate(**tok([p], return_tensors="pt", add_special_tokens=False), **gen_kw)
            dt = time.perf_counter() - t
        result["hf_sequential_tok_s"] = n_gen / dt
        result["hf_sequential_s"] = dt
    print(json.dumps(result, indent=2))
    print(f"| pagestream LLM.generate | {result['pagestream_tok_s']:.1f} tok/s |")
    print(f"| HF generate, one left-padded batch | {result['hf_batched_tok_s']:.1f} tok/s |")
    if "hf_sequential_tok_s" in result:
        print(f"| HF generate, one prompt at a time | {result['hf_sequential_tok_s']:.1f} tok/s |")


if __name__ == "__main__":
    main()
