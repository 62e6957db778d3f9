"""What every model family gives the runner and the loader, in one place."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagestream.engine.layers.attention import PagedAttention
from pagestream.kernels.reference import soft_cap


class CausalLM(nn.Module):
    """Base of the families: ``forward(input_ids, positions, meta, cos_sin_cache) -> hidden``,
    ``compute_logits(hidden)``, and the facts the runner sizes the KV pool and RoPE table by
    (``num_kv_heads``, ``head_dim``, ``rope_theta``, ``rope_scaling``).

    Loader hooks: ``packed_modules`` (HF fragment -> (packed fragment, shard index); the owning
    module's ``packed_shard_sizes`` gives the sizes) and ``hf_renames`` (HF fragment -> ours).
    """

    packed_modules: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    hf_renames: dict[str, str] = {}
    final_logit_softcap: float | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None

    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]

    def output_embedding(self) -> torch.Tensor:  # [vocab, hidden]
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        return soft_cap(F.linear(hidden, self.output_embedding()), self.final_logit_softcap)
