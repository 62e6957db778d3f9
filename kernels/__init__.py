"""Triton kernels for the paged-KV engine, each with a torch reference in `kernels.reference`.

    from pagestream.kernels import paged_decode_attention, paged_prefill_attention, store_kvcache, rms_norm, rotary_embedding, silu_and_mul, argmax

These names are the Triton wrappers (CUDA tensors; CPU only under
TRITON_INTERPRET=1); `kernels.reference` holds the same functions in plain
torch. `use_triton(device)` is the rule the engine picks by: Triton on CUDA
unless PAGESTREAM_KERNELS=torch. Importing this package compiles and launches
nothing.
"""
from __future__ import annotations

import os

import torch

# Imported eagerly, after which each name below is the function and no longer
# the submodule of the same name (`kernels.rms_norm` is callable).
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
