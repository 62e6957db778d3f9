"""Decode attention over the paged KV cache: one query token per sequence.

One program serves all query heads of one KV head (GQA packed into the rows of
one tl.dot), walks its share of the sequence's context in tiles of BLOCK_N
tokens gathered through the block table (so the tile is independent of the
cache's block_size), and keeps an online softmax in fp32. Long contexts are
split over NUM_SPLITS programs per (sequence, KV head), each taking an equal
share of that sequence's own context length, and a second kernel merges the
partial results (flash-decoding). No host sync: the split count depends only
on tensor shapes, so the launch can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

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


@triton.jit(do_not_specialize=["stride_bts"])  # the table width varies per eager step
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, cu_seqlens_ptr,
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
    qk_scale, softcap, softcap_log2e, window,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts,
    stride_os, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, Q_FROM_CU: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    if HEADS_FIRST:  # neighbouring programs read the same tokens' rows of the cache, one KV head each
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq64 = seq.to(tl.int64)
    if Q_FROM_CU:  # a mixed step: sequence i's one query is row cu[i]; longer (or empty) ones are not ours
        q_row = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
        if tl.load(cu_seqlens_ptr + seq + 1) - q_row != 1:
            return
    else:
        q_row = seq64
    ctx_len = tl.load(context_lens_ptr + seq)
    # window > 0: only the last `window` tokens are visible; the splits share just those,
    # so blocks wholly outside the window are never read.
    lo = tl.where(window > 0, tl.maximum(ctx_len - window, 0), 0)
    per_split = tl.cdiv(tl.cdiv(ctx_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + q_row * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq64 * stride_bts
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    for tok0 in range(start, end, BLOCK_N):
        toks = tok0 + offs_n
        valid = toks < end
        blocks = tl.load(bt_row + toks // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        in_block = toks % BLOCK_SIZE
        k = tl.load(k_head + (blocks * stride_kb + in_block * stride_kt)[:, None] + offs_d[None, :],
                    mask=valid[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N]
        if HAS_SOFTCAP:
            s = softcap_log2(s, softcap, softcap_log2e)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (blocks * stride_vb + in_block * stride_vt)[:, None] + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_row * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # partials: [num_seqs, num_heads, NUM_SPLITS(, HEAD_DIM)], contiguous fp32
        row = (seq64 * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, cu_seqlens_ptr,
    stride_os, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    Q_FROM_CU: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if Q_FROM_CU:
        out_row = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
        if tl.load(cu_seqlens_ptr + seq + 1) - out_row != 1:
            return
    else:
        out_row = seq
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # context_len 0: all splits empty, output 0
    w = tl.exp2(m - m_max)
    acc = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + out_row * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int) -> int:
    """The smallest power of two that gives >= 2 programs per SM, never a split shorter than 4 tiles.

    Measured on the H200 (bench/KERNELS_NOTES.md): splitting when there are already
    enough programs only costs (the reduce, partials traffic), and odd counts lose.
    """
    base = max(1, num_seqs * num_kv_heads)
    cap = max(1, max_context // (4 * block_n))
    splits = 1
    while base * splits < 2 * num_sms and splits * 2 <= min(cap, 64):
        splits *= 2
    return splits


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in cache incl. the current one
    scale: float,
    sliding_window: int | None = None,  # the query sees its last `sliding_window` tokens, itself included
    logit_softcap: float | None = None,  # scores -> cap * tanh(scores / cap) before the softmax
    *,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim], written in full
    cu_seqlens_q: torch.Tensor | None = None,  # [num_seqs + 1] int32: a mixed step's query layout (below)
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heads_first: bool = True,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    check_tensor("q", q, 3)
    check_tensor("k_cache", k_cache, 4)
    check_tensor("v_cache", v_cache, 4)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("context_lens", context_lens, 1, (torch.int32,))
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens)
    num_rows, num_heads, head_dim = q.shape
    num_seqs = num_rows
    if cu_seqlens_q is not None:
        # A mixed step (q: [num_tokens, ...]): the sequences of one query token each (row cu[i]) are
        # computed here, the rows of the others are left as they are (paged_mixed_attention).
        check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
        check_same_device(q=q, cu_seqlens_q=cu_seqlens_q)
        num_seqs = block_tables.shape[0]
        if cu_seqlens_q.shape[0] != num_seqs + 1:
            raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} does not match {num_seqs} sequences")
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q/k_cache/v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} "
                         f"do not match {num_seqs} sequences")
    check_head_dim(head_dim)
    check_block_size(block_size)
    check_window_and_softcap(sliding_window, logit_softcap)
    group = num_heads // num_kv_heads
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    if not is_pow2(block_n) or block_n < 16:
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    max_context = min(block_tables.shape[1] * block_size, sliding_window or 1 << 62)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_context, block_n, _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    out = check_out(out, q)
    if num_seqs == 0:
        return out
    if num_splits > 1:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_out = part_m = part_l = out  # unused
    # Programs are launched in grid order: with the KV heads first, the programs running together read
    # the same tokens' cache rows (all heads of a token are adjacent), 0.91 of the copy rate against 0.89
    # sequence-first on the engine's own block tables (Llama-3.2-1B, 256 x 613 tokens; bench/decode_probe.py)
    grid = (num_kv_heads, num_seqs, num_splits) if heads_first else (num_seqs, num_kv_heads, num_splits)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q if cu_seqlens_q is not None else context_lens,
        out, part_out, part_m, part_l,
        *attention_score_args(scale, logit_softcap), sliding_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, NUM_HEADS=num_heads,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SOFTCAP=logit_softcap is not None, Q_FROM_CU=cu_seqlens_q is not None, HEADS_FIRST=heads_first,
        # head_dim 64 (Llama-3.2-1B): 2 stages reach 0.88-0.94 of the copy rate against 0.82-0.85 with 3
        # (bench/results/decode_sweep_d64_h200.json); head_dim 128 measured best at 3 (KERNELS_NOTES.md)
        num_warps=num_warps or 4, num_stages=num_stages or (2 if head_dim <= 64 else 3),
    )
    if num_splits > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_m, part_l, out, cu_seqlens_q if cu_seqlens_q is not None else context_lens,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, SPLITS_PAD=next_pow2(num_splits),
            Q_FROM_CU=cu_seqlens_q is not None, num_warps=4,
        )
    return out
