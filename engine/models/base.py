"""What every model family gives the runner and the loader, in one place."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagestream.engine.parallel_state import current_tp
from pagestream.engine.layers.attention import AttentionMetadata, PagedAttention
from pagestream.engine.layers.parallel import (ParallelLMHead, local_heads, pack_cpu_linears, pack_on_cpu, packable_on_cpu,
                                               packed_linear)
from pagestream.engine.layers.rotary import rope_settings
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
    packed_output_embedding: torch.Tensor | None = None  # the LM head in oneDNN's layout (pack_for_cpu)

    def __init__(self) -> None:
        super().__init__()
        self.tp = current_tp()  # the group this model's layers are built for (size 1: no parallelism)

    def init_decoder_facts(self, cfg: dict, tie_default: bool) -> None:
        """head_dim, num_kv_heads (this rank's), RoPE settings and the LM head (None when tied) of a RoPE decoder."""
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.vocab_size = cfg["vocab_size"]
        _, self.num_kv_heads = local_heads(cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        self.rope_theta, self.rope_scaling = rope_settings(cfg)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", tie_default))
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])

    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]

    def forward(self, input_ids, positions, meta: AttentionMetadata, cos_sin_cache) -> torch.Tensor:
        return self.model(input_ids, positions, meta, cos_sin_cache)  # [num_tokens, hidden]

    def input_embedding(self) -> nn.Module:
        return self.model.embed_tokens

    def output_embedding(self) -> torch.Tensor:  # [padded vocab / tp, hidden]: this rank's rows
        return (self.input_embedding() if self.lm_head is None else self.lm_head).weight

    @torch.no_grad()
    def pack_for_cpu(self) -> None:
        """On the CPU, the linear layers and the LM head in oneDNN's packed layout (``pack_cpu_linears``): SmolLM2's
        head (49,152 x 576) at 10 rows 26.6 -> 14.9 ms on one core (BENCHMARKS.md, "Engine (CPU)"). An untied head's
        plain weight is dropped; a tied one stays the input embedding, so the packed head is a second copy of it
        (vocab x hidden floats: 113 MB for SmolLM2)."""
        pack_cpu_linears(self)
        head = self.output_embedding()
        if self.packed_output_embedding is None and packable_on_cpu(head):
            self.packed_output_embedding = pack_on_cpu(head)
            if self.lm_head is not None:
                self.lm_head.weight = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        packed = self.packed_output_embedding
        # [n, padded vocab / tp]
        logits = F.linear(hidden, self.output_embedding()) if packed is None else packed_linear(hidden, packed)
        if self.tp.size > 1:  # every rank takes part; rank 0 samples from the whole vocabulary
            logits = self.tp.gather_last_dim(logits)[:, : self.vocab_size]
        return soft_cap(logits, self.final_logit_softcap)
