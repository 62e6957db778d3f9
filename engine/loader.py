"""Weights: HF safetensors directories (one file or sharded), or random at real shapes."""
from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open
from torch import nn

from pagestream.engine.layers.norms import NORM_TYPES
from pagestream.engine.models.registry import model_class


def build_model(hf_config: dict, dtype: torch.dtype, device: torch.device, load_format: str, model_dir: str, seed: int) -> nn.Module:
    cls = model_class(hf_config)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(hf_config)
        finally:
            torch.set_default_dtype(prev)
    if load_format == "dummy":
        init_dummy_weights(model, seed, std=float(hf_config.get("initializer_range", 0.02)))
    else:
        load_weights(model, model_dir)
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # Norms keep their constructed values: 1 for RMSNorm / LayerNorm weights, 0 for Gemma's (1 + w).
    norm_params = {id(p) for m in model.modules() if isinstance(m, NORM_TYPES) for p in m.parameters()}
    for name, param in model.named_parameters():
        if id(param) in norm_params:
            continue
        if name.endswith(".bias"):
            param.zero_()
        else:
            cpu = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            param.copy_(cpu)


def _owner_and_leaf(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """('a.b.qkv_proj.weight') -> (module a.b, 'qkv_proj')."""
    parts = name.split(".")
    return model.get_submodule(".".join(parts[:-2])), parts[-2]


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: str) -> None:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir} (use load_format='dummy' for random weights)")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    packed = getattr(model, "packed_modules", {})
    renames = getattr(model, "hf_renames", {})
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and getattr(model, "lm_head", None) is None:
                    continue  # tied: the embedding serves as the head
                tensor = f.get_tensor(name)
                target, shard = name, None
                for hf_part, ours in renames.items():
                    target = target.replace(f".{hf_part}.", f".{ours}.")
                for hf_part, (packed_part, idx) in packed.items():
                    if f".{hf_part}." in target:
                        target, shard = target.replace(f".{hf_part}.", f".{packed_part}."), idx
                        break
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
                param = params[target]
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                    param.copy_(tensor)
                    loaded.add(target)
                else:
                    owner, leaf = _owner_and_leaf(model, target)
                    sizes = owner.packed_shard_sizes[leaf]
                    if tensor.shape[0] != sizes[shard]:
                        raise ValueError(f"{name}: checkpoint rows {tensor.shape[0]} != {sizes[shard]} expected")
                    param.narrow(0, sum(sizes[:shard]), sizes[shard]).copy_(tensor)
                    loaded.add(f"{target}#{shard}")
    missing = []
    for name in params:
        owner, leaf = _owner_and_leaf(model, name) if name.count(".") >= 1 else (model, name)
        shards = getattr(owner, "packed_shard_sizes", {}).get(leaf)
        if shards is not None:
            if any(f"{name}#{i}" not in loaded for i in range(len(shards))):
                missing.append(name)
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")
