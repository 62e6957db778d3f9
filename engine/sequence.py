"""A sequence: one sample of one request, as the scheduler and block manager see it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagestream.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """Tokens known (prompt + output) and how many of them are in the KV cache.

    ``num_computed_tokens`` catches up with ``num_tokens`` step by step: a prefill,
    a chunk of one, a prefix-cache hit and a decode are all the same move. The
    scheduler is the only writer of the scheduling fields (status, the counts,
    finish reasons, ``token_ids``' growth).

    With asynchronous scheduling a step is planned while the one before it is still
    on the GPU: ``num_pending_tokens`` counts tokens sampled on the device but not yet
    appended here (0 or 1 when a step is planned). Their values stay on the device
    and feed the next step there; planning counts them as known.
    """

    seq_id: str
    request_id: str
    sample_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_order: int
    priority: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit on the last admission
    # prompt tokens the prefix cache served when first scheduled (vLLM's RequestOutput.num_cached_tokens);
    # None until then. A preemption's readmission does not change it.
    first_cached_tokens: int | None = None
    num_pending_tokens: int = 0  # sampled on the device, not yet in token_ids
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # A later sample of an n>1 request waits until the first one has its prompt in
    # the cache, so the prompt's full blocks are shared instead of computed n times.
    wait_for: "Sequence | None" = None
    block_table: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus those still on the device: what the next step builds on."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_planned_output_tokens(self) -> int:
        """Index, among the outputs, of the next token this sequence samples."""
        return len(self.token_ids) + self.num_pending_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: (priority, arrival)."""
        return (self.priority, self.arrival_order)
