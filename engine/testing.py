"""Tiny random-init models written with save_pretrained, for tests and demos of the
whole path on a CPU (real files, real tokenizer, the architectures we support)."""
from __future__ import annotations

import os
import shutil


def write_tiny_model(out_dir: str | os.PathLike, arch: str = "llama", tokenizer_dir: str | None = None, seed: int = 0) -> str:
    """Write a tiny fp32 model of ``arch`` ("llama" with llama3 rope scaling, or "qwen2")
    and copy the tokenizer from ``tokenizer_dir`` beside it. Returns the directory."""
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
    if arch == "llama":
        cfg = AutoConfig.for_model(
            "llama", **common,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
        )
    elif arch == "qwen2":
        cfg = AutoConfig.for_model("qwen2", **common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(out)
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
                shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out, name))
    return out
