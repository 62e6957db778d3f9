"""Llama-family decoder (Llama 2/3, Mistral with sliding windows, Qwen2, Qwen3): GQA, RoPE
(llama3 scaling too), RMSNorm, SwiGLU, tied or untied embeddings, over a paged KV cache.

Parameter names follow HF's except that q/k/v and gate/up are packed
(``qkv_proj``, ``gate_up_proj``); ``packed_modules`` tells the loader how.
"""
from __future__ import annotations

import torch
from torch import nn

from pagestream.engine.layers.attention import SelfAttention, layer_sliding_windows
from pagestream.engine.layers.mlp import GatedMLP
from pagestream.engine.layers.norms import RMSNorm
from pagestream.engine.layers.parallel import VocabParallelEmbedding
from pagestream.engine.models.base import CausalLM


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, head_dim: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 sliding_window: int | None) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        num_heads = cfg["num_attention_heads"]
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = SelfAttention(
            cfg["hidden_size"], num_heads, cfg.get("num_key_value_heads") or num_heads, head_dim,
            qkv_bias=qkv_bias, o_bias=o_bias, scale=head_dim**-0.5, sliding_window=sliding_window,
            qk_norm_eps=eps if qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("mlp_bias", False),
                            cfg.get("hidden_act", "silu"))

    def forward(self, positions, hidden, residual, meta, cos_sin_cache):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict, head_dim: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, head_dim, qkv_bias, o_bias, qk_norm, window)
            for window in layer_sliding_windows(cfg)
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, meta, cos_sin_cache) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta, cos_sin_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.init_decoder_facts(cfg, tie_default=False)
        model_type = cfg.get("model_type")
        is_qwen2 = model_type == "qwen2"
        qkv_bias = True if is_qwen2 else bool(cfg.get("attention_bias", False))
        o_bias = False if is_qwen2 else bool(cfg.get("attention_bias", False))
        self.model = LlamaModel(cfg, self.head_dim, qkv_bias, o_bias, qk_norm=model_type == "qwen3")
