"""SiLU-and-mul of a packed gate/up projection in one pass: ``silu(x[:, :d]) * x[:, d:]``.

The gated MLP's two elementwise kernels (silu, then mul) read and write the [num_tokens,
intermediate] activations twice; fused, once. The rounding steps are torch's (HF's LlamaMLP):
silu in fp32 rounded to the activation dtype, then the product in fp32 rounded again. It is not
bit-identical to ``F.silu(gate) * up`` on the GPU (the H200 check found elements off by a
rounding step: Triton's fp32 exp and division are not torch's), so the test allows 4 ulp; the
engine's fp32 greedy tokens still equal HF's (BENCHMARKS.md, "Engine throughput").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagestream.kernels._checks import check_last_dim_contiguous, check_out, check_tensor


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr, PRECISE_EXP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    # libdevice's exp, as CUDA's expf in torch's silu (tl.exp would take the approximate ex2);
    # the interpreter has no libdevice
    if PRECISE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    act = (gate / (1.0 + e)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate then up
    *,
    out: torch.Tensor | None = None,  # [num_tokens, d]
) -> torch.Tensor:  # [num_tokens, d]
    check_tensor("x", x, 2)
    check_last_dim_contiguous("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x's last dim must be even (gate and up halves), got {x.shape[1]}")
    d = x.shape[1] // 2
    out = check_out(out, x[:, :d])
    if x.shape[0] > 0 and d > 0:
        block = min(4096, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](
            x, out, x.stride(0), out.stride(0), d, BLOCK=block, PRECISE_EXP=x.device.type == "cuda",
            num_warps=min(8, max(1, block // 512)),
        )
    return out
