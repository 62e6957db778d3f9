"""Sampling parameters, checked the way a user expects: bad values raise ValueError naming the allowed range."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagestream.engine.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request, shaped like vLLM's ``SamplingParams``.

    ``seed`` makes sampling reproducible and independent of what else is in the
    batch: the random draw for output token k depends only on (seed, sample index, k).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs returned per output token
    # per prompt position after the first: {token_id: logprob} of the prompt's token and the top k
    # (RequestOutput.prompt_logprobs, as vLLM's); such a request reads no prefix cache for its prompt
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # "delta": every step reports the new tokens and text (streaming, the worker);
    # "final": one output when the request ends (LLM.generate), so a step does no
    # per-token detokenization or output building for it (stop strings still checked live)
    output_kind: str = "delta"
    # constrain the output to a JSON schema, JSON object, regex, choice or grammar (a dict is
    # taken as StructuredOutputsParams' fields, as the queue's job schema carries it)
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    # OpenAI's logit_bias: added to these tokens' logits before sampling, each in [-100, 100]
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: only these tokens may be sampled
    allowed_token_ids: list[int] | None = None
    _stop_strs: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._stop_strs = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:  # JSON's keys are strings
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of its fields, "
                             f"got {type(self.structured_outputs).__name__}")
        self._verify()

    def _verify(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.output_kind not in ("delta", "final"):
            raise ValueError(f"output_kind must be 'delta' or 'final', got {self.output_kind!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        for t, bias in (self.logit_bias or {}).items():
            if t < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias maps token ids >= 0 to values in [-100, 100], got {t}: {bias}")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strs(self) -> list[str]:
        return self._stop_strs

    @property
    def biases_logits(self) -> bool:
        """``logit_bias`` or ``allowed_token_ids`` change the logits before sampling (no token history needed)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
