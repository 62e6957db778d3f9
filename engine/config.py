"""Engine configuration: one dataclass, checked on construction (no torch here)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from pagestream.engine.models.registry import SUPPORTED_ARCHITECTURES, resolve_architecture  # noqa: F401

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# What a hub snapshot needs for the engine: config, weights, tokenizer files, chat template.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def resolve_model(model: str, what: str = "model") -> str:
    """A local directory (with config.json for a model), or a Hugging Face hub id
    (``org/name`` or ``org/name@revision``) resolved by huggingface_hub: from the local cache
    first, downloading only when that misses and the hub is reachable (HF_HUB_OFFLINE unset).
    Returns the directory; raises ValueError saying what was tried."""
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        return str(path)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id, _, revision = model.partition("@")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ValueError(f"unknown {what} {model!r}: expected a local directory (with config.json, written with "
                         "save_pretrained) or a hub id ('org/name' or 'org/name@revision')") from None
    revision = revision or None
    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=_HUB_PATTERNS)
    except Exception as cache_miss:  # huggingface_hub's LocalEntryNotFoundError and kin
        where = f"not in the Hugging Face cache {constants.HF_HUB_CACHE} ({type(cache_miss).__name__})"
    if constants.is_offline_mode():
        raise ValueError(f"{what} {model!r}: {where}, and HF_HUB_OFFLINE is set so nothing is downloaded; "
                         "pass a local directory or fill the cache first")
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_PATTERNS)
    except Exception as exc:  # network down, unknown repo, gated, bad revision: one clear error
        raise ValueError(f"{what} {model!r}: {where}, and downloading it failed: {type(exc).__name__}: {exc}") from None


def check_tensor_parallel(hf_config: dict, tp: int) -> None:
    """Raise ValueError unless the model splits evenly over ``tp`` ranks: attention heads and the
    MLP's hidden width divide by tp; KV heads divide by tp, or tp by them (then each KV head is
    replicated on tp / num_kv_heads ranks). The vocabulary is padded, so it need not divide."""
    heads = int(hf_config["num_attention_heads"])
    kv = int(hf_config.get("num_key_value_heads") or heads)
    if heads % tp:
        raise ValueError(f"num_attention_heads ({heads}) must be divisible by tensor_parallel_size ({tp})")
    if kv % tp and tp % kv:
        raise ValueError(f"num_key_value_heads ({kv}) and tensor_parallel_size ({tp}) must divide one another "
                         "(KV heads are split across ranks, or replicated when there are fewer than ranks)")
    for key in ("intermediate_size", "ffn_dim"):  # Llama-style families / OPT
        if key in hf_config and int(hf_config[key]) % tp:
            raise ValueError(f"{key} ({hf_config[key]}) must be divisible by tensor_parallel_size ({tp})")


def knob(default: Any, help: str, show: str | None = None) -> Any:
    """An engine setting users choose: ``EngineConfig``'s field, and from it the worker's settings
    (``PAGESTREAM_<NAME>``), the ``--<name>`` option of ``pagestream worker`` and ``serve`` and their help
    (``worker/engine_options.py``). A new knob is this one line. ``show``: the default as ``--help`` says it."""
    return field(default=default, metadata={"help": help, "show_default": show})


@dataclass(frozen=True, slots=True)
class Knob:
    name: str
    type: Any
    default: Any
    help: str
    show_default: str | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def engine_knobs() -> list[Knob]:
    """Every knob of ``EngineConfig``, in its order."""
    hints = get_type_hints(EngineConfig)
    return [Knob(f.name, hints[f.name], f.default, f.metadata["help"], f.metadata["show_default"])
            for f in fields(EngineConfig) if "help" in f.metadata]


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start.

    KV cache size: ``num_kv_blocks`` wins when given. Otherwise on CUDA the pool
    takes ``gpu_memory_utilization`` of the device's memory minus weights and
    activations; on CPU it takes ``kv_cache_bytes``.
    """

    model: str
    tokenizer: str | None = knob(None, "tokenizer directory or hub id", show="the model's")
    dtype: str = knob("auto", "auto | float32 | float16 | bfloat16 (auto: float32 on the CPU, the checkpoint's "
                      "dtype, bf16 for fp32 ones, on CUDA)")
    device: str = knob("auto", "auto (CUDA when present) | cpu | cuda[:N]")
    block_size: int = knob(16, "tokens per KV block (a power of two)")
    num_kv_blocks: int | None = knob(None, "KV blocks in the pool (wins over the memory settings)",
                                     show="from gpu_memory_utilization or kv_cache_bytes")
    gpu_memory_utilization: float = knob(0.85, "share of the GPU's memory the engine may take (weights, "
                                         "activations and the KV pool)")
    kv_cache_bytes: int = knob(512 * 2**20, "bytes of KV pool on the CPU")
    # Sequences at once. vLLM takes 1024 on cards of >= 70 GiB. On the H200, 1,000 lognormal requests
    # ran 0.53 of the floor at 512 against 0.48 at 256 (BENCHMARKS.md, issue 9's third pass; earlier,
    # with a costlier host step, 1024 had run 0.32 against 0.38 at 256): 512 is also the largest batch
    # that decode CUDA graphs cover. More sequences trade time per output token for throughput.
    max_num_seqs: int = knob(512, "sequences the engine runs at once")
    max_num_batched_tokens: int = knob(8192, "token budget of one engine step")
    max_model_len: int | None = knob(None, "longest prompt + output, in tokens", show="the model's")
    enable_prefix_caching: bool = knob(True, "reuse the KV blocks of prompt prefixes already computed")
    load_format: str = knob("auto", "auto | dummy (random weights at the model's real shapes)")
    seed: int = knob(0, "seed of the engine's sampling for requests without one")
    enforce_eager: bool = knob(False, "no CUDA graphs for decode steps")
    # plan step N+1 while step N runs on the device (outputs come one step later); False waits for each step
    async_scheduling: bool = knob(True, "plan and launch step N+1 while step N runs on the device")
    # GPUs one engine spans (one process each; rank 0 is this process): weights, KV heads and
    # vocabulary split across them. On the CPU the same code runs over gloo with as many processes.
    tensor_parallel_size: int = knob(1, "GPUs one engine spans, one process each")
    # The host CPU time a structured-output request's matchers may take (issue 37): an ambiguous grammar's
    # mask can cost 300 ms a step and slow every neighbour; over a bound, the request ends with an error.
    # A JSON schema's matcher takes ~0.01-0.1 ms per token on SmolLM2's vocabulary: 50 ms a step is a
    # request that by itself doubles a full decode step, 10 s is ~100k such tokens' worth.
    grammar_step_limit_ms: float = knob(50.0, "host time one sequence's structured-output grammar may take in "
                                        "one step before its request ends with an error (0: no limit)")
    grammar_request_limit_s: float = knob(10.0, "host time a request's structured-output grammar may take in "
                                          "all before it ends with an error (0: no limit)")
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # filled in __post_init__
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        path = Path(resolve_model(str(self.model)))
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model {self.model!r} resolved to {path}, which has no config.json "
                             "(an HF model directory written with save_pretrained is expected)")
        self.model = str(path)
        if self.tokenizer is not None:
            self.tokenizer = resolve_model(str(self.tokenizer), what="tokenizer")
        self.hf_config = {**json.loads(config_file.read_text()), **self.hf_overrides}
        resolve_architecture(self.hf_config, where=f"model {self.model!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        model_max = int(self.hf_config.get("max_position_embeddings", 2048))
        if self.max_model_len is None:
            self.max_model_len = model_max
        if not 2 <= self.max_model_len <= model_max:
            raise ValueError(f"max_model_len must be in [2, {model_max}] for this model, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        for name in ("grammar_step_limit_ms", "grammar_request_limit_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0 (0: no limit), got {value!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1:
            if str(self.device).startswith("cuda:"):
                raise ValueError(f"device {self.device!r} names one GPU; with tensor_parallel_size="
                                 f"{self.tensor_parallel_size} rank r runs on cuda:r: pass device='cuda' (or 'auto')")
            check_tensor_parallel(self.hf_config, self.tensor_parallel_size)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model
