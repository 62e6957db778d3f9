"""Normalisation layers shared by the model families."""
from __future__ import annotations

import torch
from torch import nn

from pagestream.engine.layers.ops import kernel_ops


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm (Llama, Mistral, Qwen2/3, Qwen3's per-head q/k norms), residual add fused."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernel_ops(x.device).rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scaled by (1 + weight), the product taken in fp32 before the cast back
    (Llama casts first), so it is not RMSNorm with weight + 1."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


# Norm weights keep their constructed identity values under load_format="dummy".
NORM_TYPES = (RMSNorm, GemmaRMSNorm, nn.LayerNorm)
