"""Weights: HF safetensors directories (one file or sharded), or random at real shapes."""
from __future__ import annotations

import glob
import hashlib
import os

import torch
from safetensors import safe_open
from torch import nn

from pagestream.engine.layers.norms import NORM_TYPES
from pagestream.engine.models.registry import model_class


def construct_model(hf_config: dict, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model's modules with uninitialised parameters (this rank's shard under tensor_parallel).
    On the meta device nothing is allocated: that is how the runner sizes a model before loading it."""
    cls = model_class(hf_config)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return cls(hf_config)
        finally:
            torch.set_default_dtype(prev)


def build_model(hf_config: dict, dtype: torch.dtype, device: torch.device, load_format: str, model_dir: str, seed: int) -> nn.Module:
    model = construct_model(hf_config, dtype, device)
    if load_format == "dummy":
        init_dummy_weights(model, seed, std=float(hf_config.get("initializer_range", 0.02)))
    else:
        load_weights(model, model_dir)
    if device.type == "cpu":
        model.pack_for_cpu()
    return model.eval()


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float) -> None:
    # Norms keep their constructed values: 1 for RMSNorm / LayerNorm weights, 0 for Gemma's (1 + w).
    norm_params = {id(p) for m in model.modules() if isinstance(m, NORM_TYPES) for p in m.parameters()}
    tp = getattr(model, "tp", None)
    sharded = tp is not None and tp.size > 1
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if id(param) in norm_params:
            continue
        if name.endswith(".bias"):
            param.zero_()
        elif sharded:
            # Only this rank's shard is drawn, on its own device (a 70B-sized model's worth of
            # normals on the host would take minutes). Replicated parameters draw the same values on
            # every rank (seeded by name), sharded ones their own; so TP=N's random model is not
            # TP=1's, only as plausible.
            key = f"{seed}:{name}:{tp.rank if getattr(param, 'tp_sharded', False) else 'all'}"
            g = torch.Generator(device=param.device).manual_seed(_seed_of(key))
            param.normal_(0.0, std, generator=g)
        else:
            cpu = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            param.copy_(cpu)


def _seed_of(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


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
    done: set[str] = set()
    packed = getattr(model, "packed_modules", {})
    renames = getattr(model, "hf_renames", {})
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and getattr(model, "lm_head", None) is None:
                    continue  # tied: the embedding serves as the head
                # A lazy slice: a sharded parameter's weight_loader reads only its rank's rows or columns.
                loaded = f.get_slice(name)
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
                weight_loader = getattr(param, "weight_loader", None)
                if weight_loader is not None:  # parallel layers: packed parts, shards of the checkpoint tensor
                    try:
                        weight_loader(param, loaded, shard)
                    except ValueError as exc:
                        raise ValueError(f"{name}: {exc}") from None
                elif shard is None:
                    if tuple(param.shape) != tuple(loaded.get_shape()):
                        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.get_shape())} != model {tuple(param.shape)}")
                    param.copy_(loaded[:])
                else:
                    raise ValueError(f"{name}: packed into {target}, which has no weight_loader")
                done.add(target if shard is None else f"{target}#{shard}")
    missing = []
    for name in params:
        owner, leaf = _owner_and_leaf(model, name) if name.count(".") >= 1 else (model, name)
        shards = getattr(owner, "packed_shard_sizes", {}).get(leaf)
        if shards is not None:
            if any(f"{name}#{i}" not in done for i in range(len(shards))):
                missing.append(name)
        elif name not in done:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")
