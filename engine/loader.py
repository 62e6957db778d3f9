"""Weights: HF safetensors directories (one file or sharded), or random at real shapes."""
from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open
from torch import nn

from pagestream.engine.models.llama import LlamaForCausalLM

_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class(hf_config: dict) -> type[nn.Module]:
    for arch in hf_config.get("architectures") or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ValueError(f"unsupported architectures {hf_config.get('architectures')}; supported: {sorted(_ARCHITECTURES)}")


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
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            cpu = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            param.copy_(cpu)


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: str) -> None:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir} (use load_format='dummy' for random weights)")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    packed = getattr(model, "packed_modules", {})
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                tensor = f.get_tensor(name)
                target, shard = name, None
                for hf_part, (packed_part, idx) in packed.items():
                    if f".{hf_part}." in name:
                        target, shard = name.replace(f".{hf_part}.", f".{packed_part}."), idx
                        break
                if name == "lm_head.weight" and getattr(model, "lm_head", None) is None:
                    continue  # tied: the embedding serves as the head
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
                param = params[target]
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                    param.copy_(tensor)
                    loaded.add(target)
                else:
                    sizes = model.shard_sizes(target.split(".")[-2])
                    offset = sum(sizes[:shard])
                    param.narrow(0, offset, sizes[shard]).copy_(tensor)
                    loaded.add(f"{target}#{shard}")
    missing = []
    for name in params:
        packed_name = name.split(".")[-2] if "." in name else name
        if packed_name in ("qkv_proj", "gate_up_proj"):
            n = 3 if packed_name == "qkv_proj" else 2
            if any(f"{name}#{i}" not in loaded for i in range(n)):
                missing.append(name)
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")
