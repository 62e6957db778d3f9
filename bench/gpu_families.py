"""Each model family at a real shape through the engine (Triton path on CUDA), against HF.

    . bench/device_env.sh && python3 bench/gpu_families.py --out $OUT/families.json    # on the H200, ~4 min
    python bench/gpu_families.py --tiny --out /tmp/families.json                         # logic check on a CPU

Per family (random init from an HF config with from_config, weights rounded to bf16 and
written with save_pretrained, so every run below reads the same numbers):
  - first-step logits relative error vs HF fp32, for the engine in bf16 and for HF in bf16;
    ratio = engine / HF (<= 1.1 wanted: the engine no further from fp32 than HF's own bf16);
  - engine fp32 vs HF fp32: greedy tokens on a few prompts (identical wanted; a prompt that
    differs first at an HF near-tie is reported as such).
Shapes: OPT-125m, Qwen3-0.6B, Mistral-7B with 8 of its 32 layers and a 128-token window
(the prompts are 150-400 tokens, so the window bites), Gemma-2-2B with its soft-caps and a
128-token window on its alternating sliding layers. HF runs sdpa, Gemma 2 eager (HF's only
path with soft-capping). Prints one table and writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_engine import _free, compare, engine_run, hf_run, log  # noqa: E402

# model_type -> HF config kwargs at the real shape
FAMILIES = {
    "opt-125m": ("opt", dict(vocab_size=50272, hidden_size=768, ffn_dim=3072, num_hidden_layers=12,
                             num_attention_heads=12, word_embed_proj_dim=768, max_position_embeddings=2048,
                             do_layer_norm_before=True, bos_token_id=2, eos_token_id=2, pad_token_id=1)),
    "qwen3-0.6b": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mistral-7b-8layers-w128": ("mistral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                                num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                                                max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=128,
                                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gemma2-2b-w128": ("gemma2", dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                                      num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                      query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                      final_logit_softcapping=30.0, sliding_window=128, max_position_embeddings=8192,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
TINY = {  # the same families at CPU size: checks this script's logic, not the numbers
    "opt-tiny": ("opt", dict(vocab_size=1000, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                             word_embed_proj_dim=32, max_position_embeddings=1024, init_std=0.2)),
    "qwen3-tiny": ("qwen3", dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2)),
    "mistral-tiny-w24": ("mistral", dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
                                         initializer_range=0.2)),
    "gemma2-tiny-w20": ("gemma2", dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                                       final_logit_softcapping=15.0, sliding_window=20, initializer_range=0.2)),
}


def write_model(model_type: str, shape: dict, path: str, device: torch.device) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **shape)
    torch.manual_seed(0)
    with torch.device(device):  # init on the GPU: seconds, not minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(path)  # bf16 on disk: exact in fp32 too, half the bytes
    del model
    _free(device)


def run_family(name, model_type, shape, args, device, tmp):
    t0 = time.perf_counter()
    path = os.path.join(tmp, name)
    write_model(model_type, shape, path, device)
    gen = torch.Generator().manual_seed(1)
    lo, hi = (40, 90) if args.tiny else (150, 400)
    prompts = [torch.randint(3, shape["vocab_size"], (int(n),), generator=gen).tolist()
               for n in torch.randint(lo, hi, (args.num_prompts,), generator=gen)]
    attn = "eager" if model_type == "gemma2" else "sdpa"
    llm_kwargs = {"max_model_len": 1024, "max_num_seqs": 8}
    eng_bf16 = engine_run(path, device, "bfloat16", prompts, args.new_tokens, args, **llm_kwargs)
    eng_fp32 = engine_run(path, device, "float32", prompts, args.new_tokens, args, **llm_kwargs)
    hf_bf16 = hf_run(path, device, torch.bfloat16, attn, prompts, args.new_tokens)
    hf_fp32 = hf_run(path, device, torch.float32, attn, prompts, args.new_tokens)
    eng_err = compare(*eng_bf16, *hf_fp32, args.new_tokens)["first_step_logits_rel_err_mean"]
    hf_err = compare(*hf_bf16[:2], *hf_fp32, args.new_tokens)["first_step_logits_rel_err_mean"]
    fp32 = compare(*eng_fp32, *hf_fp32, args.new_tokens)
    return {
        "model_type": model_type, "shape": shape, "prompts": len(prompts), "new_tokens": args.new_tokens,
        "hf_attn": attn,
        "engine_bf16_logits_rel_err_vs_hf_fp32": eng_err,
        "hf_bf16_logits_rel_err_vs_hf_fp32": hf_err,
        "ratio": eng_err / hf_err if hf_err > 0 else float("inf"),
        "fp32_prompts_identical": fp32["prompts_fully_identical"],
        "fp32_prompts_stopped_at_a_near_tie": fp32["prompts_stopped_at_a_tie"],
        "fp32_token_agreement": fp32["agreement"],
        "fp32_engine_vs_hf_first_step_logits_rel_err": fp32["first_step_logits_rel_err_mean"],
        "seconds": time.perf_counter() - t0,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU logic check)")
    ap.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    ap.add_argument("--families", default=None, help="comma-separated subset of the family names")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    table = TINY if args.tiny else FAMILIES
    names = args.families.split(",") if args.families else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {', '.join(table)}")
    import transformers
    import triton

    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
           "kernels": "triton" if device.type == "cuda" and os.environ.get("PAGESTREAM_KERNELS") != "torch" else "torch",
           "families": {}}
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        for name in names:
            model_type, shape = table[name]
            log(f"== {name}")
            res["families"][name] = run_family(name, model_type, shape, args, device, tmp)
            log(json.dumps(res["families"][name], default=str))
            with open(args.out, "w") as f:  # after each family, so a timeout keeps what finished
                json.dump(res, f, indent=1, default=str)
    log(f"\n{'family':26} {'eng bf16 err':>12} {'HF bf16 err':>12} {'ratio':>6} {'fp32 identical':>15} {'s':>5}")
    for name, r in res["families"].items():
        ident = f"{r['fp32_prompts_identical']}/{r['prompts']}"
        if r["fp32_prompts_stopped_at_a_near_tie"]:
            ident += f" ({r['fp32_prompts_stopped_at_a_near_tie']} tie)"
        log(f"{name:26} {r['engine_bf16_logits_rel_err_vs_hf_fp32']:12.3e} {r['hf_bf16_logits_rel_err_vs_hf_fp32']:12.3e} "
            f"{r['ratio']:6.2f} {ident:>15} {r['seconds']:5.0f}")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
