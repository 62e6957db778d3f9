"""Paged attention as the model layers see it; the metadata travels as an argument."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagestream.engine.layers.norms import RMSNorm
from pagestream.engine.layers.ops import kernel_ops
from pagestream.engine.layers.parallel import RowParallelLinear, local_heads, qkv_parallel


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step batch layout, built by the ModelRunner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor  # [num_seqs] int32, tokens in cache after this step
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int
    decode_only: bool  # every sequence has exactly one query token
    # some sequence (not all) has exactly one query token; a captured mixed step assumes so
    has_single_query_seqs: bool = True


def layer_sliding_windows(cfg: dict, default_layer_types: list[str] | None = None) -> list[int | None]:
    """Each layer's sliding window (None: full attention), from an HF config.

    transformers 5 writes ``layer_types`` ("sliding_attention" / "full_attention") beside
    ``sliding_window``; older Mistral configs have only ``sliding_window`` (every layer), and
    Qwen2/3 configs turn it off with ``use_sliding_window: false``.
    """
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return [None] * num_layers
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive int or null in config.json, got {window!r}")
    types = cfg.get("layer_types") or default_layer_types or ["sliding_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return [window if t == "sliding_attention" else None for t in types]


class PagedAttention(nn.Module):
    """Attention over the paged cache; the layer's own facts (scale, sliding window, logit
    soft-cap) live here, so the runner needs to know nothing about model families."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # [num_blocks, block_size, num_kv_heads, head_dim], views into the runner's pool
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ops = kernel_ops(q.device)
        # Every token's K/V is stored before any attention reads: sequences that
        # share a block registered this step (prefix cache) rely on it.
        ops.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.decode_only:
            return ops.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens,
                                              self.scale, self.sliding_window, self.logit_softcap)
        # A step with decode rows beside its prompts sends those rows to the decode kernel.
        attend = ops.paged_mixed_attention if meta.has_single_query_seqs else ops.paged_prefill_attention
        return attend(
            q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, self.scale,
            meta.max_seqlen_q, self.sliding_window, self.logit_softcap,
        )


class SelfAttention(nn.Module):
    """Packed QKV projection, optional per-head q/k RMSNorm (Qwen3), RoPE (unless
    ``rotary=False``, as OPT), paged attention, output projection.

    ``num_heads`` / ``num_kv_heads`` are the model's; under tensor parallelism this rank holds
    num_heads / tp query heads and max(1, num_kv_heads / tp) KV heads (QKV column-parallel by
    heads, o_proj row-parallel: one all-reduce)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *, qkv_bias: bool,
                 o_bias: bool, scale: float, sliding_window: int | None = None, logit_softcap: float | None = None,
                 qk_norm_eps: float | None = None, rotary: bool = True) -> None:
        super().__init__()
        self.qkv_proj = qkv_parallel(hidden, num_heads, num_kv_heads, head_dim, qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias)
        num_heads, num_kv_heads = local_heads(num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window, logit_softcap)
        self.packed_shard_sizes = {"qkv_proj": [self.q_size, self.kv_size, self.kv_size]}

    def forward(self, positions, hidden, meta: AttentionMetadata, cos_sin_cache) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # per head: rows of head_dim
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary:
            q, k = kernel_ops(q.device).rotary_embedding(positions, q, k, cos_sin_cache)
        out = self.attn(q, k, v, meta)  # [num_tokens, num_heads (this rank's), head_dim]
        return self.o_proj(out.reshape(-1, self.q_size))  # [num_tokens, hidden], summed over ranks
