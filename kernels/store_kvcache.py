"""Write the new tokens' K/V into the paged cache at their slots (slot -1: skip)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagestream.kernels._checks import (
    INDEX_DTYPES,
    check_head_dim,
    check_last_dim_contiguous,
    check_same_device,
    check_tensor,
    next_pow2,
)


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_t, stride_kc_h,
    stride_vc_b, stride_vc_t, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = offs_h[:, None] < NUM_KV_HEADS
    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token64 * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + block * stride_kc_b + offset * stride_kc_t + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    vc = v_cache_ptr + block * stride_vc_b + offset * stride_vc_t + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = skip
) -> None:
    for name, t, nd in (("key", key, 3), ("value", value, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        check_tensor(name, t, nd)
        check_last_dim_contiguous(name, t)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not fit key [.., {num_kv_heads}, {head_dim}]")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    check_head_dim(head_dim)
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
