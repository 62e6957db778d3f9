"""Greedy sampling's argmax over each row of the logits, in two passes: the first index of each row's maximum.

torch's argmax over [256, 128256] bf16 logits (Llama-3's vocabulary, a decode step of 256 sequences) ran
at about a third of the H200's bandwidth (47 us for 66 MB); here one program takes one chunk of one row
(16 chunks a row at that vocabulary), and a second pass picks each row's best chunk: 25 us
(bench/decode_probe.py). Ties go to the lowest index in both passes, as torch's do. A NaN counts as
the largest value, as in torch (a row holding both NaN and +inf returns whichever comes first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagestream.kernels._checks import check_last_dim_contiguous, check_tensor, next_pow2


@triton.jit
def _chunk_argmax_kernel(x_ptr, vals_ptr, idx_ptr, V, stride_x, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN wins, as in torch
    v, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(vals_ptr + row * NUM_CHUNKS + chunk, v)
    tl.store(idx_ptr + row * NUM_CHUNKS + chunk, (i + chunk * CHUNK).to(tl.int64))


@triton.jit
def _pick_chunk_kernel(vals_ptr, idx_ptr, out_ptr, NUM_CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS_PAD)
    v = tl.load(vals_ptr + row * NUM_CHUNKS + offs, mask=offs < NUM_CHUNKS, other=float("-inf"))
    _, j = tl.max(v, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * NUM_CHUNKS + j))


def argmax(x: torch.Tensor, chunk: int = 8192) -> torch.Tensor:  # [rows, V] -> [rows] int64
    check_tensor("x", x, 2)
    check_last_dim_contiguous("x", x)
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax of an empty row")
    chunk = min(chunk, max(16, next_pow2(vocab)))
    num_chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, num_chunks, dtype=torch.int64, device=x.device)
    _chunk_argmax_kernel[(rows, num_chunks)](x, vals, idx, vocab, x.stride(0), CHUNK=chunk, NUM_CHUNKS=num_chunks,
                                             num_warps=8 if chunk >= 4096 else 4)
    _pick_chunk_kernel[(rows,)](vals, idx, out, NUM_CHUNKS=num_chunks, CHUNKS_PAD=next_pow2(num_chunks), num_warps=1)
    return out
