"""Gemma 2: embedding scaled by sqrt(hidden), (1 + weight) RMSNorm before and after both
attention and MLP, GeGLU (gelu tanh), attention-logit and final-logit soft-capping,
sliding and global layers alternating, query scale from ``query_pre_attn_scalar``."""
from __future__ import annotations

import torch
from torch import nn

from pagestream.engine.layers.attention import SelfAttention, layer_sliding_windows
from pagestream.engine.layers.mlp import GatedMLP
from pagestream.engine.layers.norms import GemmaRMSNorm
from pagestream.engine.layers.parallel import VocabParallelEmbedding
from pagestream.engine.models.base import CausalLM


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, head_dim: int, sliding_window: int | None) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        num_heads = cfg["num_attention_heads"]
        bias = bool(cfg.get("attention_bias", False))
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = SelfAttention(
            hidden, num_heads, cfg.get("num_key_value_heads") or num_heads, head_dim, qkv_bias=bias, o_bias=bias,
            scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5, sliding_window=sliding_window,
            logit_softcap=cfg.get("attn_logit_softcapping"),
        )
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, cfg["intermediate_size"], False,
                            cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions, hidden, meta, cos_sin_cache) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), meta, cos_sin_cache)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma2Model(nn.Module):
    def __init__(self, cfg: dict, head_dim: int) -> None:
        super().__init__()
        self.hidden_size = cfg["hidden_size"]
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], self.hidden_size)
        num_layers = cfg["num_hidden_layers"]
        # transformers 4 configs have no layer_types: sliding on even layers, as HF's default
        default_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(cfg, head_dim, window) for window in layer_sliding_windows(cfg, default_types)
        )
        self.norm = GemmaRMSNorm(self.hidden_size, cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, meta, cos_sin_cache) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        # As HF: the scale is rounded to the activation dtype first.
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden, meta, cos_sin_cache)
        return self.norm(hidden)


class Gemma2ForCausalLM(CausalLM):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.init_decoder_facts(cfg, tie_default=True)
        self.model = Gemma2Model(cfg, self.head_dim)
        self.final_logit_softcap = cfg.get("final_logit_softcapping")
