"""HF ``architectures`` -> implementation. Plain Python (no torch): EngineConfig checks
against it before anything heavy loads; the loader imports the class lazily."""
from __future__ import annotations

import importlib

# architecture -> (module under pagestream.engine.models, class)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),  # + sliding windows from the config
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),  # + q/k/v biases
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),  # + per-head q/k RMSNorm
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(sorted(ARCHITECTURES))


def resolve_architecture(hf_config: dict, where: str = "the model") -> str:
    """The first of the config's ``architectures`` we implement, else a ValueError listing ours."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise ValueError(f"{where} has architectures {archs}, none of which is supported; "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def model_class(hf_config: dict):
    module, name = ARCHITECTURES[resolve_architecture(hf_config)]
    return getattr(importlib.import_module(f"pagestream.engine.models.{module}"), name)
