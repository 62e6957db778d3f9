"""What the engine hands back, shaped like vLLM's outputs."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request.

    From ``LLMEngine.step()`` this is a delta: ``token_ids`` and ``text`` are what
    is new since the previous step, and ``first_token_index`` is the index (among
    this sample's output tokens) of ``token_ids[0]``. From ``LLM.generate`` it is
    the whole output and ``first_token_index`` is 0.
    """

    index: int
    text: str
    token_ids: list[int]
    first_token_index: int = 0
    cumulative_logprob: float | None = None
    # per output token: {token_id: logprob} for the sampled token and the top-k
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # set when the request ended with an error instead of output (never raised inside step())
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # when asked (SamplingParams.prompt_logprobs): per prompt token, None for the first, then {token_id: logprob}
    # of the prompt's token and the top k. In the first output that has them (delta) or the final one.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # vLLM's: prompt tokens served from the prefix cache when the request was first scheduled (its first
    # sample's); 0 before it is known. Set on every output once the core has reported it.
    num_cached_tokens: int = 0


#: steps' token counts an engine keeps for ``take_iteration_tokens`` (a worker takes them every step; a caller
#: that never does, the offline ``LLM``, keeps only the newest this many)
ITERATION_TOKENS_KEPT = 65536


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float  # fraction of blocks in use
    kv_waste: float  # fraction of allocated slots holding no token
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_generated_tokens: int
    # the last admission stopped on the KV pool (or a preemption), not on the step's token budget:
    # more requests would only wait in this engine
    kv_bound: bool = False
    # structured outputs: grammars compiled, and requests that found theirs compiled already
    structured_compilations: int = 0
    structured_cache_hits: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
