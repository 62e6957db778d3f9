"""How much device memory a model's weights take per GPU, known before anything is loaded, so a
model too large for its GPUs is refused with the figure instead of dying in an allocation."""
from __future__ import annotations

import torch

from pagestream.engine.config import check_tensor_parallel
from pagestream.engine.parallel_state import TPGroup, tensor_parallel
from pagestream.engine.loader import construct_model, weight_bytes

GiB = 2**30


def weight_bytes_per_gpu(hf_config: dict, dtype: torch.dtype, tensor_parallel_size: int) -> int:
    """Bytes of rank 0's shard of the weights (the largest, or equal to the others), counted on
    the meta device: the model is built, nothing is allocated."""
    with tensor_parallel(TPGroup(0, tensor_parallel_size, None)):
        return weight_bytes(construct_model(hf_config, dtype, torch.device("meta")))


def check_weights_fit(hf_config: dict, dtype: torch.dtype, tensor_parallel_size: int, gpu_bytes: int,
                      gpu_memory_utilization: float, num_gpus: int = 8) -> int:
    """Raise ValueError when the weights alone exceed ``gpu_memory_utilization`` of one GPU's
    ``gpu_bytes``; the message says how much they need and at which tensor_parallel_size they would
    fit. Returns the bytes per GPU."""
    need = weight_bytes_per_gpu(hf_config, dtype, tensor_parallel_size)
    allowed = int(gpu_bytes * gpu_memory_utilization)
    if need <= allowed:
        return need
    hint = f"no tensor_parallel_size up to {num_gpus} makes them fit"
    for tp in range(tensor_parallel_size + 1, num_gpus + 1):
        try:
            check_tensor_parallel(hf_config, tp)
        except ValueError:
            continue
        per = weight_bytes_per_gpu(hf_config, dtype, tp)
        if per <= allowed:
            hint = f"at tensor_parallel_size={tp} they take {per / GiB:.1f} GiB per GPU"
            break
    raise ValueError(
        f"the model's weights need {need / GiB:.1f} GiB per GPU at tensor_parallel_size={tensor_parallel_size} "
        f"({dtype}), more than gpu_memory_utilization={gpu_memory_utilization} of a {gpu_bytes / GiB:.1f} GiB GPU "
        f"({allowed / GiB:.1f} GiB, before any KV cache); {hint}"
    )
