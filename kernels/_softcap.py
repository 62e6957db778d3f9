"""Soft-capping of attention scores inside the attention kernels (Gemma 2): cap * tanh(s / cap)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softcap_log2(s, softcap, softcap_log2e):
    """cap * tanh(s / cap) * log2(e). tanh from exp2 with a non-positive exponent, so it never
    overflows (libdevice's tanh has no Triton-interpreter counterpart)."""
    x = s / softcap
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t) * softcap_log2e
