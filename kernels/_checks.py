"""Argument checks shared by the kernel wrappers: real errors on bad input, before any launch."""
from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype {t.dtype} not supported; allowed: {', '.join(map(str, dtypes))}")
    if not t.is_cuda and not interpreting():
        raise ValueError(f"{name} must be a CUDA tensor (use kernels.reference on {t.device})")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dim, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def check_head_dim(head_dim: int) -> None:
    if not is_pow2(head_dim) or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")


def check_block_size(block_size: int) -> None:
    if not is_pow2(block_size) or not 1 <= block_size <= 1024:
        raise ValueError(f"block_size must be a power of two in [1, 1024], got {block_size}")


def check_out(out: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype | None = None,
              name: str = "out") -> torch.Tensor:
    """`out` if it fits `like` (shape, device; dtype or `like`'s), else a fresh tensor when `out` is None."""
    dtype = dtype or like.dtype
    if out is None:
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    if out.shape != like.shape or out.dtype != dtype or out.device != like.device:
        raise ValueError(f"{name} must be {tuple(like.shape)} {dtype} on {like.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    check_last_dim_contiguous(name, out)
    return out


LOG2E = 1.4426950408889634


def attention_score_args(scale: float, logit_softcap: float | None) -> tuple[float, float, float]:
    """(qk_scale, softcap, softcap * LOG2E) for the attention kernels, which work in base 2.

    Without a soft cap the log2(e) factor folds into the scale; with one it must come
    after the tanh, so the cap carries it.
    """
    if logit_softcap is None:
        return scale * LOG2E, 1.0, LOG2E
    return scale, float(logit_softcap), float(logit_softcap) * LOG2E


def check_window_and_softcap(sliding_window: int | None, logit_softcap: float | None) -> None:
    """Shared by the references and the Triton wrappers: None turns each feature off."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1 (tokens a query sees, itself included), "
                         f"got {sliding_window!r}")
    if logit_softcap is not None and (isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float))
                                      or not logit_softcap > 0):
        raise ValueError(f"logit_softcap must be None or a number > 0, got {logit_softcap!r}")
