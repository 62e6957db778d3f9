"""Feed-forward blocks: gated (SwiGLU, GeGLU) and plain (OPT's fc1 -> act -> fc2)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagestream.engine.layers.ops import kernel_ops
from pagestream.engine.layers.parallel import ColumnParallelLinear, RowParallelLinear

_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
}


def activation(name: str):
    """The torch function for an HF activation name (hidden_act / hidden_activation / activation_function)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; allowed: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up packed into one matmul (column-parallel:
    each rank holds intermediate / tp columns of both) and down row-parallel (one all-reduce)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.split(hidden, [intermediate, intermediate], bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias)
        self.act = activation(act)
        self.packed_shard_sizes = {"gate_up_proj": self.gate_up_proj.local_sizes}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [n, 2 * intermediate / tp]
        if self.act is F.silu:  # one fused pass (Triton on CUDA), as torch would round it
            return self.down_proj(kernel_ops(x.device).silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [n, intermediate / tp] each
        return self.down_proj(self.act(gate) * up)


class PlainMLP(nn.Module):
    """fc2(act(fc1(x))), as OPT."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear.split(hidden, [intermediate], bias)
        self.fc2 = RowParallelLinear(intermediate, hidden, bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
