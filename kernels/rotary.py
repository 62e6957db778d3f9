"""Neox-style rotary embedding (rotate_half, as HF Llama/Qwen2) from a cos|sin cache, not in place.

Products and the sum are rounded to the activation dtype in the same order as HF's
`q * cos + rotate_half(q) * sin`, and FP fusion is off for this kernel so the compiler
keeps those roundings (with it on, sm_90 code fused them into bf16 fma and differed from
HF by about one ulp on many elements: relative error ~2e-3 in BENCHMARKS.md's run).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagestream.kernels._checks import (
    INDEX_DTYPES,
    check_head_dim,
    check_last_dim_contiguous,
    check_out,
    check_same_device,
    check_tensor,
    next_pow2,
)


@triton.jit
def _rotate(x_ptr, o_ptr, stride_xt, stride_xh, stride_ot, stride_oh, token, cos, sin,
            NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF)
    mask = offs_h[:, None] < NUM_HEADS
    x_base = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    o_base = o_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    dtype = o_ptr.dtype.element_ty
    x1 = tl.load(x_base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :].to(dtype).to(tl.float32)
    s = sin[None, :].to(dtype).to(tl.float32)
    a1 = (x1 * c).to(dtype).to(tl.float32)
    b1 = (x2 * s).to(dtype).to(tl.float32)
    a2 = (x2 * c).to(dtype).to(tl.float32)
    b2 = (x1 * s).to(dtype).to(tl.float32)
    tl.store(o_base, (a1 - b1).to(dtype), mask=mask)
    tl.store(o_base + HALF, (a2 + b2).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    NUM_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs)
    _rotate(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, cos, sin,
            NUM_HEADS, Q_HEADS_PAD, HALF)
    _rotate(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, cos, sin,
            NUM_KV_HEADS, KV_HEADS_PAD, HALF)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32: cos | sin
    *,
    q_out: torch.Tensor | None = None,  # like q; may be q itself (in place)
    k_out: torch.Tensor | None = None,  # like k; may be k itself (in place)
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor("positions", positions, 1, INDEX_DTYPES)
    check_tensor("q", q, 3)
    check_tensor("k", k, 3)
    check_tensor("cos_sin_cache", cos_sin_cache, 2, (torch.float32,))
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape[0] != num_tokens:
        raise ValueError(f"positions {tuple(positions.shape)}, q {tuple(q.shape)} and k {tuple(k.shape)} disagree")
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} != q dtype {q.dtype}")
    check_head_dim(head_dim)
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"rotary_dim {cos_sin_cache.shape[1]} != head_dim {head_dim}: partial rotary is not supported")
    q_out = check_out(q_out, q, name="q_out")
    k_out = check_out(k_out, k, name="k_out")
    if num_tokens > 0:
        num_kv_heads = k.shape[1]
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_sin_cache, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            NUM_HEADS=num_heads, Q_HEADS_PAD=next_pow2(num_heads),
            NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=next_pow2(num_kv_heads),
            HALF=head_dim // 2,
            num_warps=4 if num_heads * head_dim >= 2048 else 2,
            # Without this the compiler fuses `round(x * cos) - round(x2 * sin)` into one
            # bf16 fma (one rounding, not HF's two): off by an ulp from HF on many elements.
            enable_fp_fusion=False,
        )
    return q_out, k_out
