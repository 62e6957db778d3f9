"""Tiny random-init models written with save_pretrained, for tests and demos of the
whole path on a CPU (real files, real tokenizer, the architectures we support)."""
from __future__ import annotations

import os
import shutil


TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "opt", "opt-post-ln")


def write_tiny_model(out_dir: str | os.PathLike, arch: str = "llama", tokenizer_dir: str | None = None, seed: int = 0,
                     **overrides) -> str:
    """Write a tiny fp32 model of ``arch`` and copy the tokenizer from ``tokenizer_dir`` beside it.

    Each shape exercises its family's quirks: "llama" has llama3 rope scaling, "qwen2" q/k/v
    biases, "qwen3" per-head q/k norms, "mistral" a 24-token sliding window (shorter than the
    test prompts), "gemma2" soft-capping, alternating 20-token windows and a query scale that
    is not head_dim's, "opt" project_in/out (word_embed_proj_dim != hidden_size) with pre-LN and
    "opt-post-ln" the same with LayerNorm after each block (opt-350m's layout). OPT gets no chat
    template, like facebook/opt-125m. ``overrides`` replace config fields (e.g.
    ``num_key_value_heads=1``). Returns the directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = str(out_dir)
    vocab = 49152
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        cfg = AutoConfig.for_model(
            "llama", **common,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
        )
    elif arch in ("qwen2", "qwen3"):
        cfg = AutoConfig.for_model(arch, **common, head_dim=16,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "mistral":
        cfg = AutoConfig.for_model("mistral", **common, sliding_window=24,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "gemma2":
        cfg = AutoConfig.for_model(
            "gemma2", **{**common, "num_hidden_layers": 4, "tie_word_embeddings": True}, head_dim=16,
            query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=15.0, sliding_window=20,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    elif arch in ("opt", "opt-post-ln"):
        cfg = AutoConfig.for_model(
            "opt", vocab_size=vocab, hidden_size=64, word_embed_proj_dim=32, ffn_dim=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=1024, init_std=0.2,
            do_layer_norm_before=arch == "opt", bos_token_id=1, eos_token_id=2, pad_token_id=2, **overrides,
        )
    else:
        raise ValueError(f"arch must be one of {', '.join(TINY_ARCHS)}, got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = 2
    if arch.startswith("opt"):
        # HF leaves OPT's LayerNorms at (1, 0) and biases at 0: random ones make the parity check mean more
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "layer_norm" in name or name.endswith(".bias"):
                    param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
                if arch.startswith("opt") and name == "chat_template.jinja":
                    continue
                shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out, name))
        if arch.startswith("opt"):
            _drop_chat_template(out)
    return out


def _drop_chat_template(model_dir: str) -> None:
    import json

    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(path):
        cfg = json.loads(open(path).read())
        cfg.pop("chat_template", None)
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
