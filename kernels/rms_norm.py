"""RMSNorm with an optional fused residual add, matching HF LlamaRMSNorm bit for bit in spirit:
the add in the activation dtype, the norm in fp32, `weight * normed.to(x.dtype)`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagestream.kernels._checks import check_last_dim_contiguous, check_out, check_same_device, check_tensor, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # HF adds in the activation dtype: round the sum before normalising it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / hidden
    normed = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden] (or [..., hidden])
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
    *,
    out: torch.Tensor | None = None,  # [num_tokens, hidden]
    residual_out: torch.Tensor | None = None,  # [num_tokens, hidden]; may be `residual` itself
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if x.dim() > 2:  # [..., hidden]: run on the flattened rows
        lead, hidden = x.shape[:-1], x.shape[-1]
        res = rms_norm(
            x.reshape(-1, hidden), weight, eps,
            None if residual is None else residual.reshape(-1, hidden),
            out=None if out is None else out.view(-1, hidden),
            residual_out=None if residual_out is None else residual_out.view(-1, hidden),
        )
        if residual is None:
            return res.view(*lead, hidden)
        return res[0].view(*lead, hidden), res[1].view(*lead, hidden)
    check_tensor("x", x, 2)
    check_tensor("weight", weight, 1)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    hidden = x.shape[1]
    if weight.shape[0] != hidden:
        raise ValueError(f"weight has {weight.shape[0]} elements for hidden size {hidden}")
    if residual is not None:
        check_tensor("residual", residual, 2)
        check_last_dim_contiguous("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} != x dtype {x.dtype}")
        check_same_device(x=x, weight=weight, residual=residual)
    else:
        check_same_device(x=x, weight=weight)
    block = next_pow2(hidden)
    if block > 65536:
        raise ValueError(f"hidden size {hidden} too large (max 65536)")
    out = check_out(out, x, torch.promote_types(weight.dtype, x.dtype))
    residual_out = check_out(residual_out, x, name="residual_out") if residual is not None else None
    if x.shape[0] > 0:
        _rms_norm_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, weight, out,
            residual_out if residual_out is not None else out,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            residual_out.stride(0) if residual_out is not None else 0,
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, residual_out)
