"""Linear and embedding layers split over tensor-parallel ranks (Megatron's layout).

Column-parallel: each rank holds a slice of the output features (QKV by heads, gate/up by
intermediate columns); no communication. Row-parallel: each rank holds a slice of the input
features and the partial products are summed with one all-reduce. Vocab-parallel: each rank holds
a contiguous range of the (padded) vocabulary for the embedding (rows outside it give 0; summed)
and for the LM head (logits gathered). At tensor_parallel_size 1 every layer is the plain one.

Each sharded parameter carries ``weight_loader(param, loaded, shard)``: ``loaded`` is a
safetensors slice of the checkpoint tensor (``shard``: which packed part it is, or None), and the
loader reads only this rank's rows or columns of it, so no rank ever holds the whole tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagestream.engine.parallel_state import TPGroup, current_tp


def _linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if layer.packed_weight is not None:  # the CPU's oneDNN layout (pack_cpu_linears)
        return packed_linear(x, layer.packed_weight, bias)
    return F.linear(x, layer.weight, bias)


def _check_rows(name: str, loaded, want: int, param: torch.Tensor) -> None:
    shape = list(loaded.get_shape())
    if shape[0] != want or shape[1:] != list(param.shape[1:]):
        raise ValueError(f"{name}: checkpoint shape {tuple(shape)}, the model expects {(want, *param.shape[1:])}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the output features split: ``parts`` are the packed outputs (HF's
    separate q/k/v or gate/up), each given as (full size, rows per rank, first row on this rank)."""

    def __init__(self, in_features: int, parts: list[tuple[int, int, int]], bias: bool) -> None:
        super().__init__()
        self.tp: TPGroup = current_tp()
        self.parts = parts
        self.local_sizes = [local for _, local, _ in parts]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features))  # [out / tp, in]
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.packed_weight: torch.Tensor | None = None
        for p in self.parameters():
            p.weight_loader = self.weight_loader
            p.tp_sharded = self.tp.size > 1

    @classmethod
    def split(cls, in_features: int, out_sizes: list[int], bias: bool) -> "ColumnParallelLinear":
        """Each part split evenly over the ranks."""
        tp = current_tp()
        parts = []
        for size in out_sizes:
            if size % tp.size:
                raise ValueError(f"output size {size} is not divisible by tensor_parallel_size {tp.size}")
            local = size // tp.size
            parts.append((size, local, tp.rank * local))
        return cls(in_features, parts, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out / tp]
        return _linear(self, x, self.bias)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded, shard: int | None) -> None:
        if shard is None:
            if len(self.parts) != 1:
                raise ValueError(f"a packed layer of {len(self.parts)} parts got an unpacked checkpoint tensor")
            shard = 0
        full, local, start = self.parts[shard]
        _check_rows(f"part {shard}", loaded, full, param)
        offset = sum(self.local_sizes[:shard])
        param.narrow(0, offset, local).copy_(loaded[start : start + local])


def qkv_parallel(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> ColumnParallelLinear:
    """QKV split by heads. With fewer KV heads than ranks each KV head is replicated: rank r holds
    KV head r // (tp / num_kv_heads), the one its query heads read in the unsplit model."""
    tp = current_tp()
    q_local = num_heads // tp.size * head_dim
    if num_kv_heads >= tp.size:
        kv_local = num_kv_heads // tp.size * head_dim
        kv_start = tp.rank * kv_local
    else:
        kv_local = head_dim
        kv_start = tp.rank // (tp.size // num_kv_heads) * head_dim
    kv_full = num_kv_heads * head_dim
    parts = [(num_heads * head_dim, q_local, tp.rank * q_local), (kv_full, kv_local, kv_start), (kv_full, kv_local, kv_start)]
    return ColumnParallelLinear(hidden, parts, bias)


def local_heads(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(query heads, KV heads) on this rank."""
    tp = current_tp()
    return num_heads // tp.size, max(1, num_kv_heads // tp.size)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the input features split: each rank multiplies its slice, one
    all-reduce sums them, and the bias (whole on every rank) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.tp: TPGroup = current_tp()
        if in_features % self.tp.size:
            raise ValueError(f"input size {in_features} is not divisible by tensor_parallel_size {self.tp.size}")
        self.in_local = in_features // self.tp.size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local))  # [out, in / tp]
        self.weight.weight_loader = self.weight_loader
        self.weight.tp_sharded = self.tp.size > 1
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in / tp] -> [n, out]
        if self.tp.size == 1:
            return _linear(self, x, self.bias)
        y = self.tp.all_reduce(_linear(self, x, None))
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded, shard: int | None) -> None:
        shape = loaded.get_shape()
        if list(shape) != [param.shape[0], self.in_local * self.tp.size]:
            raise ValueError(f"checkpoint shape {tuple(shape)} != model {(param.shape[0], self.in_local * self.tp.size)}")
        start = self.tp.rank * self.in_local
        param.copy_(loaded[:, start : start + self.in_local])


def packable_on_cpu(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_on_cpu(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's packed layout, for ``packed_linear`` (16: the batch-size hint it packs for)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.no_grad()
def pack_cpu_linears(model: nn.Module) -> int:
    """Move the float32 weights of a CPU model's column- and row-parallel layers into oneDNN's packed layout, as
    vLLM's CPU backend prepacks its GEMM weights: a decode step reads every weight once, and oneDNN reads the
    packed layout faster than MKL's F.linear reads the plain one (BENCHMARKS.md, "Engine (CPU)"). The plain weight is
    dropped (the layer's ``weight`` becomes None), so the model's memory stays the same. The results differ from
    F.linear's by float32 rounding only (the sums run in another order). Returns how many layers were packed."""
    n = 0
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None and packable_on_cpu(m.weight):
            m.packed_weight = pack_on_cpu(m.weight)
            m.weight = None
            n += 1
    return n


class VocabParallelEmbedding(nn.Module):
    """Embedding over a vocabulary padded to a multiple of the ranks; rank r holds rows
    [r * per_rank, (r + 1) * per_rank). Ids outside a rank's range look up 0 there; the
    all-reduce then leaves every token its one row."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp: TPGroup = current_tp()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp.size)
        self.vocab_start = self.tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))  # [padded vocab / tp, dim]
        self.weight.weight_loader = self.weight_loader
        self.weight.tp_sharded = self.tp.size > 1

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, dim]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0))

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded, shard: int | None) -> None:
        _check_rows("vocabulary", loaded, self.num_embeddings, param)
        end = min(self.vocab_start + self.per_rank, self.num_embeddings)
        n = max(0, end - self.vocab_start)
        if n:
            param[:n].copy_(loaded[self.vocab_start : end])
        param[n:].zero_()  # padding rows: never looked up, their logits cut off after the gather


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head: the embedding's layout, used as ``logits = hidden @ W^T`` per rank
    (``CausalLM.compute_logits`` gathers the vocabulary slices)."""

    def forward(self, x):  # pragma: no cover - the head is applied by compute_logits
        raise NotImplementedError("use CausalLM.compute_logits")
