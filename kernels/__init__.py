"""Triton kernels for the paged-KV engine, each with a torch reference in `kernels.reference`.

    from kernels import paged_decode_attention, paged_prefill_attention, store_kvcache, rms_norm, rotary_embedding

These names are the Triton wrappers (CUDA tensors only); `kernels.reference`
holds the same functions in plain torch. `use_triton(device)` is the rule the
engine picks by: Triton on CUDA unless PAGESTREAM_KERNELS=torch. Importing this
package launches nothing; triton itself is imported on first use of a wrapper.
"""
from __future__ import annotations

import importlib
import os

import torch

__all__ = [
    "use_triton",
    "store_kvcache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
]

_WRAPPERS = {
    "store_kvcache": "kernels.store_kvcache",
    "paged_decode_attention": "kernels.paged_decode_attention",
    "paged_prefill_attention": "kernels.paged_prefill_attention",
    "rms_norm": "kernels.rms_norm",
    "rotary_embedding": "kernels.rotary",
}


def use_triton(device: torch.device | str) -> bool:
    """True when the Triton kernels should run on `device`: CUDA, and PAGESTREAM_KERNELS is not "torch"."""
    if os.environ.get("PAGESTREAM_KERNELS", "").strip().lower() == "torch":
        return False
    return torch.device(device).type == "cuda"


def __getattr__(name: str):
    # Lazy so that `import kernels` stays cheap and needs no triton on a CPU-only install.
    if name in _WRAPPERS:
        fn = getattr(importlib.import_module(_WRAPPERS[name]), name)
        globals()[name] = fn
        return fn
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
