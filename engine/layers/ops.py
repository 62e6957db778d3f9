"""Which kernels the layers call: Triton or the torch references."""
from __future__ import annotations

import torch

from pagestream.kernels import triton_ops as kernels
from pagestream.kernels import reference


def kernel_ops(device: torch.device):
    """Triton on CUDA, the torch reference on CPU or with PAGESTREAM_KERNELS=torch."""
    return kernels if kernels.use_triton(device) else reference
