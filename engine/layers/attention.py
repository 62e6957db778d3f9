"""Paged attention as the model layers see it; the metadata travels as an argument."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagestream import kernels
from pagestream.kernels import reference


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step batch layout, built by the ModelRunner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor  # [num_seqs] int32, tokens in cache after this step
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int
    decode_only: bool  # every sequence has exactly one query token


def kernel_ops(device: torch.device):
    """Triton on CUDA, the torch reference on CPU or with PAGESTREAM_KERNELS=torch."""
    return kernels if kernels.use_triton(device) else reference


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
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
            return ops.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens, self.scale)
        return ops.paged_prefill_attention(
            q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, self.scale,
            meta.max_seqlen_q,
        )
