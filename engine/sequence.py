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
    scheduler is the only writer of the scheduling fields.
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
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: (priority, arrival)."""
        return (self.priority, self.arrival_order)
