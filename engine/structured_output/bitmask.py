"""The token mask on the logits: one row of int32 words per constrained request, applied on
the device (xgrammar's kernel: CUDA/Triton there, a CPU kernel here) before sampling.

Rows of unconstrained requests are not touched (``indices``), and a logits width padded
past the grammar's vocabulary (an LM head rounded up) keeps its pad columns masked.
"""
from __future__ import annotations

import torch
import xgrammar as xgr


def allocate_bitmask(num_rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32 on the host (pinned if asked), every token allowed."""
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    return bitmask.pin_memory() if pin_memory else bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Set to -inf, in place, the logits of tokens ``bitmask`` forbids, for the rows ``rows`` of ``logits``.

    logits: [num_rows, width] float (width >= vocab_size: columns past it are padding and forbidden)
    bitmask: [num_rows, ceil(vocab_size / 32)] int32, host or device; row i masks logits row i
    """
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not match logits {tuple(logits.shape)} row for row")
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"bitmask of {bitmask.shape[1]} words cannot cover a vocabulary of {vocab_size}")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    width = logits.shape[1]
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab_size, width), indices=rows)
    if width > vocab_size:
        logits[rows, vocab_size:] = float("-inf")
