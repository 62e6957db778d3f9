"""Triton kernels for the paged-KV engine, each with a torch reference in `kernels.reference`.

    from pagestream.kernels.triton_ops import paged_decode_attention, paged_prefill_attention, store_kvcache, rms_norm, rotary_embedding, silu_and_mul, argmax

These names are the Triton wrappers (CUDA tensors; CPU only under
TRITON_INTERPRET=1); `kernels.reference` holds the same functions in plain
torch. `use_triton(device)` is the rule the engine picks by: Triton on CUDA
unless PAGESTREAM_KERNELS=torch. Importing this module compiles and launches
nothing.

`kernels/` has no `__init__.py` on purpose: it is a namespace portion, so with the checkout's
root on sys.path (pytest, `make demo`, `python -c` there) the top-level name `kernels` still
resolves to Hugging Face's regular `kernels` package, which transformers imports
(tests/test_layout.py guards this). Our code imports it only as `pagestream.kernels`.
"""
from __future__ import annotations

import os

import torch

# Imported eagerly: each name below is the function (`triton_ops.rms_norm` is callable).
from pagestream.kernels.argmax import argmax
from pagestream.kernels.paged_decode_attention import paged_decode_attention
from pagestream.kernels.paged_prefill_attention import paged_mixed_attention, paged_prefill_attention
from pagestream.kernels.rms_norm import rms_norm
from pagestream.kernels.rotary import rotary_embedding
from pagestream.kernels.silu_and_mul import silu_and_mul
from pagestream.kernels.store_kvcache import store_kvcache

__all__ = [
    "use_triton",
    "store_kvcache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_mixed_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "argmax",
]


def use_triton(device: torch.device | str) -> bool:
    """True when the Triton kernels should run on `device`: CUDA, and PAGESTREAM_KERNELS is not "torch"."""
    if os.environ.get("PAGESTREAM_KERNELS", "").strip().lower() == "torch":
        return False
    return torch.device(device).type == "cuda"
