"""Variable-length causal attention over the paged KV cache.

Serves prefill, chunked prefill, prefix-cache-hit suffixes and decode rows (query
length 1) in one mixed batch. Sequence i's queries q[cu[i]:cu[i+1]] are the last
tokens of its context of context_lens[i] tokens, all of whose K/V are already in
the cache; a query at absolute position p sees cache positions 0..p.

One program takes BLOCK_Q query tokens of one sequence times all GROUP query
heads of one KV head: BLOCK_M = BLOCK_Q * GROUP_PAD rows of one tl.dot, so a K/V
tile gathered through the block table serves the whole group. The grid is flat
over query blocks (num_tokens // BLOCK_Q + num_seqs of them, an upper bound that
needs no host sync); each program finds its sequence by binary search over
cu_seqlens_q and returns at once if it has no queries. Tiles left of the
causal diagonal run without a mask.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagestream.kernels._checks import (
    attention_score_args,
    check_block_size,
    check_head_dim,
    check_window_and_softcap,
    check_last_dim_contiguous,
    check_out,
    check_same_device,
    check_tensor,
    is_pow2,
    next_pow2,
)
from pagestream.kernels._softcap import softcap_log2


@triton.jit
def _find_seq(cu_seqlens_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence i owns query blocks [cu[i] // BLOCK_Q + i, cu[i + 1] // BLOCK_Q + i + 1).
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k_ptrs_base, v_ptrs_base, bt_row, tok0, kv_lo, kv_end, q_pos, q_lo, offs_n, offs_d,
    stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap, softcap_log2e,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    # q_lo: [BLOCK_M], each row sees tokens in (q_lo, q_pos]; q_lo = -1 without a sliding window.
    # Tokens before kv_lo are outside every row's window: not loaded (their blocks may hold anything).
    toks = tok0 + offs_n
    if MASKED:
        valid = (toks < kv_end) & (toks >= kv_lo)
        blocks = tl.load(bt_row + toks // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        blocks = tl.load(bt_row + toks // BLOCK_SIZE).to(tl.int64)
    in_block = toks % BLOCK_SIZE
    k_ptrs = k_ptrs_base + (blocks * stride_kb + in_block * stride_kt)[:, None] + offs_d[None, :]
    v_ptrs = v_ptrs_base + (blocks * stride_vb + in_block * stride_vt)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if HAS_SOFTCAP:
        s = softcap_log2(s, softcap, softcap_log2e)
    if MASKED:
        seen = (toks[None, :] <= q_pos[:, None]) & (toks[None, :] > q_lo[:, None]) & valid[None, :]
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # With a window a row may see nothing in this tile and nothing before it: keep its exponents finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_seqs", "stride_bts"])  # they vary per step: no compile mid-run
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr,
    qk_scale, softcap, softcap_log2e, window, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, SKIP_SINGLE: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(cu_seqlens_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    if SKIP_SINGLE:  # sequences of one query token are the decode kernel's (paged_mixed_attention)
        if q_len == 1:
            return
    ctx_len = tl.load(context_lens_ptr + seq)
    first_pos = ctx_len - q_len  # absolute position of the sequence's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    tok = local_block * BLOCK_Q + offs_m // GROUP_PAD  # query index within the sequence
    g = offs_m % GROUP_PAD
    row_mask = (tok < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    q_pos = first_pos + tok  # [BLOCK_M]

    block_first_pos = first_pos + local_block * BLOCK_Q
    kv_end = tl.minimum(block_first_pos + BLOCK_Q, ctx_len)  # last query in the block sees up to kv_end - 1
    unmasked_end = (block_first_pos + 1) // BLOCK_N * BLOCK_N  # tiles every query in the block sees whole

    # Sliding window (window > 0): row p sees (p - window, p]. Tiles left of the block's first
    # window are skipped, so are the cache blocks wholly outside it; tiles every row sees
    # whole run unmasked; the left edge and the diagonal run masked.
    q_lo = tl.where(window > 0, q_pos - window, -1)
    kv_lo = tl.where(window > 0, tl.maximum(block_first_pos - window + 1, 0), 0)
    lo = kv_lo // BLOCK_N * BLOCK_N
    unmasked_lo = tl.where(window > 0, tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    for tok0 in range(lo, tl.minimum(unmasked_lo, unmasked_end), BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, tok0, kv_lo, kv_end, q_pos, q_lo, offs_n,
                                     offs_d, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap,
                                     softcap_log2e, BLOCK_SIZE, True, DOT_PRECISION, HAS_SOFTCAP)
    for tok0 in range(unmasked_lo, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, tok0, kv_lo, kv_end, q_pos, q_lo, offs_n,
                                     offs_d, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap,
                                     softcap_log2e, BLOCK_SIZE, False, DOT_PRECISION, HAS_SOFTCAP)
    for tok0 in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, tok0, kv_lo, kv_end, q_pos, q_lo, offs_n,
                                     offs_d, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap,
                                     softcap_log2e, BLOCK_SIZE, True, DOT_PRECISION, HAS_SOFTCAP)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def default_config(head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """Tile sizes, tuned on the H200 in bf16 (bench/KERNELS_NOTES.md): 128x128 tiles, 8 warps, 3 stages at
    head_dim 128; at head_dim <= 64, 128x64 tiles and 2 stages (32 prompts x 512 tokens, Llama-3.2-1B's
    heads: 203 us against 345 us with the head_dim-128 tiles, and 236 us for flash SDPA; bench/decode_probe.py)."""
    if dtype == torch.float32 or head_dim > 128:
        return {"block_m": max(64, next_pow2(group)), "block_n": 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 64:
        return {"block_m": max(128, next_pow2(group)), "block_n": 64, "num_warps": 8, "num_stages": 2}
    return {"block_m": max(128, next_pow2(group)), "block_n": 128, "num_warps": 8, "num_stages": 3}


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in cache incl. the new ones
    scale: float,
    max_seqlen_q: int | None = None,  # accepted for the reference's signature; the grid needs no max
    sliding_window: int | None = None,  # a query sees its last `sliding_window` tokens, itself included
    logit_softcap: float | None = None,  # scores -> cap * tanh(scores / cap) before the softmax
    *,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], written in full
    skip_single_query_seqs: bool = False,  # leave the rows of sequences with one query token as they are
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    check_tensor("q", q, 3)
    check_tensor("k_cache", k_cache, 4)
    check_tensor("v_cache", v_cache, 4)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    check_tensor("context_lens", context_lens, 1, (torch.int32,))
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens)):
        check_last_dim_contiguous(name, t)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q/k_cache/v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, block_tables {tuple(block_tables.shape)} and "
                         f"context_lens {tuple(context_lens.shape)} disagree on the number of sequences")
    check_head_dim(head_dim)
    check_block_size(block_size)
    check_window_and_softcap(sliding_window, logit_softcap)
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    cfg = default_config(head_dim, group, q.dtype)
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    if not is_pow2(block_m) or block_m < max(16, group_pad):
        raise ValueError(f"block_m must be a power of two >= max(16, group padded to a power of two), got {block_m}")
    if not is_pow2(block_n) or block_n < 16:
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    block_q = block_m // group_pad

    out = check_out(out, q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens,
        *attention_score_args(scale, logit_softcap), sliding_window or 0, num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SOFTCAP=logit_softcap is not None, SKIP_SINGLE=skip_single_query_seqs,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
    return out


def paged_mixed_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in cache incl. the new ones
    scale: float,
    max_seqlen_q: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``paged_prefill_attention``'s result for a continuous-batching step that mixes prompts with
    decode rows: the sequences of one query token go to the decode kernel (split over the context,
    one K/V read per group of heads), the others to the prefill kernel. The prefill kernel's tiles
    of 32 queries hold one useful query in a decode row: on Llama-3.2-1B's shape it took 3x the
    decode kernel's time for 256 decode rows (bench/gpu_kernels.py --mixed-d64-only).
    Both launches size their grids from the step's shapes alone, so a CUDA graph can hold them."""
    from pagestream.kernels.paged_decode_attention import paged_decode_attention

    out = paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_seqlen_q,
                                  sliding_window, logit_softcap, out=out, skip_single_query_seqs=True)
    # One program per (sequence, KV head), no split of the context: one kernel variant whatever the
    # step's shape (a split count is a compile-time constant), and the decode rows of a mixed step
    # run beside its prompts' programs, which keep the SMs busy.
    return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                                  logit_softcap, out=out, cu_seqlens_q=cu_seqlens_q, num_splits=1)
