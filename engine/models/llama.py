"""Llama-family decoder (Llama 2/3, Mistral, Qwen2): GQA, RoPE (llama3 scaling too),
RMSNorm, SwiGLU, tied or untied embeddings, over a paged KV cache.

Parameter names follow HF's except that q/k/v and gate/up are packed
(``qkv_proj``, ``gate_up_proj``); ``packed_modules`` tells the loader how.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagestream.engine.layers.attention import AttentionMetadata, PagedAttention, kernel_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernel_ops(x.device).rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict, head_dim: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_bias)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5)

    def forward(self, positions, hidden, meta: AttentionMetadata, cos_sin_cache) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = kernel_ops(q.device).rotary_embedding(positions, q, k, cos_sin_cache)
        out = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, head_dim: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = LlamaAttention(cfg, head_dim, qkv_bias, o_bias)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("mlp_bias", False))

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
    def __init__(self, cfg: dict, head_dim: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, head_dim, qkv_bias, o_bias) for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, meta, cos_sin_cache) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta, cos_sin_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers 4 or 5 style configs."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    return theta, scaling


class LlamaForCausalLM(nn.Module):
    # HF name fragment -> (packed name fragment, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        is_qwen2 = cfg.get("model_type") == "qwen2"
        qkv_bias = True if is_qwen2 else bool(cfg.get("attention_bias", False))
        o_bias = False if is_qwen2 else bool(cfg.get("attention_bias", False))
        self.model = LlamaModel(cfg, self.head_dim, qkv_bias, o_bias)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.num_kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        self.rope_theta, self.rope_scaling = rope_settings(cfg)

    def shard_sizes(self, packed: str) -> list[int]:
        attn = self.model.layers[0].self_attn
        if packed == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = self.cfg["intermediate_size"]
        return [inter, inter]

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids, positions, meta: AttentionMetadata, cos_sin_cache) -> torch.Tensor:
        return self.model(input_ids, positions, meta, cos_sin_cache)  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)
