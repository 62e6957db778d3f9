"""OPT (facebook/opt-*): learned absolute positions (row = position + 2), LayerNorm before
or after each block per ``do_layer_norm_before``, ReLU MLP, biases everywhere, and
``project_in`` / ``project_out`` when ``word_embed_proj_dim != hidden_size`` (opt-350m)."""
from __future__ import annotations

import torch
from torch import nn

from pagestream.engine.layers.attention import AttentionMetadata, SelfAttention
from pagestream.engine.layers.mlp import PlainMLP
from pagestream.engine.layers.parallel import ParallelLMHead, VocabParallelEmbedding, local_heads
from pagestream.engine.models.base import CausalLM

POSITION_OFFSET = 2  # OPT's learned position table starts two rows in (a fairseq legacy)


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        bias = bool(cfg.get("enable_bias", True))
        affine = bool(cfg.get("layer_norm_elementwise_affine", True))
        head_dim = hidden // heads
        self.do_layer_norm_before = bool(cfg.get("do_layer_norm_before", True))
        self.self_attn = SelfAttention(hidden, heads, heads, head_dim, qkv_bias=bias, o_bias=bias,
                                       scale=head_dim**-0.5, rotary=False)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.mlp = PlainMLP(hidden, cfg["ffn_dim"], bias, cfg.get("activation_function", "relu"))
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, positions, hidden, meta, cos_sin_cache) -> torch.Tensor:
        pre = self.do_layer_norm_before
        h = self.self_attn_layer_norm(hidden) if pre else hidden
        hidden = hidden + self.self_attn(positions, h, meta, cos_sin_cache)
        if not pre:
            hidden = self.self_attn_layer_norm(hidden)
        h = self.final_layer_norm(hidden) if pre else hidden
        hidden = hidden + self.mlp(h)
        return hidden if pre else self.final_layer_norm(hidden)


class OPTDecoder(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        embed_dim = cfg.get("word_embed_proj_dim") or hidden
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], embed_dim)
        self.embed_positions = nn.Embedding(cfg["max_position_embeddings"] + POSITION_OFFSET, hidden)
        self.project_in = nn.Linear(embed_dim, hidden, bias=False) if embed_dim != hidden else None
        self.project_out = nn.Linear(hidden, embed_dim, bias=False) if embed_dim != hidden else None
        self.final_layer_norm = None
        if cfg.get("do_layer_norm_before", True) and not cfg.get("_remove_final_layer_norm", False):
            self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=cfg.get("layer_norm_elementwise_affine", True))
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))

    def forward(self, input_ids, positions, meta, cos_sin_cache) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, word_embed_proj_dim]
        if self.project_in is not None:
            hidden = self.project_in(hidden)  # [num_tokens, hidden]
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            hidden = layer(positions, hidden, meta, cos_sin_cache)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden  # [num_tokens, word_embed_proj_dim]


class OPTModel(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg)


class OPTForCausalLM(CausalLM):
    hf_renames = {"out_proj": "o_proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
    packed_modules = {k: v for k, v in CausalLM.packed_modules.items() if v[0] == "qkv_proj"}

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = OPTModel(cfg)
        self.vocab_size = cfg["vocab_size"]
        self.lm_head = None
        if not cfg.get("tie_word_embeddings", True):
            embed_dim = cfg.get("word_embed_proj_dim") or cfg["hidden_size"]
            self.lm_head = ParallelLMHead(cfg["vocab_size"], embed_dim)
        self.head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        _, self.num_kv_heads = local_heads(cfg["num_attention_heads"], cfg["num_attention_heads"])

    def forward(self, input_ids, positions, meta: AttentionMetadata, cos_sin_cache) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, meta, cos_sin_cache)  # [num_tokens, word_embed_proj_dim]

    def input_embedding(self) -> nn.Module:
        return self.model.decoder.embed_tokens
