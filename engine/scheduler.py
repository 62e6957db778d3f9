"""Continuous batching under one token budget (vLLM v1's model, plain Python).

Every step hands each chosen sequence a number of tokens so that its computed
tokens catch up with its known tokens: a prompt (possibly in chunks), the
uncached suffix after a prefix-cache hit, or one decode token are the same
thing. Tokens sampled by a step still on the GPU count as known
(``num_pending_tokens``): the next step is planned before they reach the host.
Running sequences are served first, in priority order; waiting ones are
admitted while the budget, ``max_num_seqs`` and the KV pool allow. When the
pool runs dry the lowest-priority running sequence is preempted: its blocks are
freed and it recomputes later (the prefix cache usually gives most of it back).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pagestream.engine.block_manager import BlockManager
from pagestream.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One step: {sequence: tokens to compute}, in batch order."""

    num_scheduled_tokens: dict[Sequence, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    # every sequence that left the running set since the last step (finished, aborted or
    # preempted): the model runner frees their rows of the persistent batch
    left: list[Sequence] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class Scheduler:
    """Owns the waiting and running queues and every sequence's scheduling fields."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0
        self._left: list[Sequence] = []  # left the running set since the last schedule()
        # the last schedule() preempted, or left a waiting sequence out for want of blocks
        self.kv_bound = False

    # ---- queue changes ---------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End seq (stop, length, abort) and give its blocks back."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._left.append(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        out.left, self._left = self._left, out.left
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        running = self.running
        scheduled = out.num_scheduled_tokens
        max_model_len = self.max_model_len
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            # This loop runs for every running sequence every step: plain fields, no properties.
            pending = seq.num_pending_tokens
            planned = len(seq.token_ids) + pending
            num_new = planned - seq.num_computed_tokens
            if num_new <= 0 or (pending and (
                    planned >= max_model_len
                    or (seq.params.max_tokens is not None and planned - seq.num_prompt_tokens >= seq.params.max_tokens))):
                # nothing to compute, or the token still on the device is its last one (max_tokens
                # or the model's length): it ends when that token arrives, so it needs no step now
                i += 1
                continue
            if num_new > budget:
                num_new = budget
            if bm.allocate_slots(seq, num_new):
                scheduled[seq] = num_new
                budget -= num_new
                i += 1
                continue
            while not bm.allocate_slots(seq, num_new):
                victim = running[-1]  # lowest priority, latest arrival
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled[seq] = num_new
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: nothing below it can run either

        # Admit new work only when nobody had to be preempted this step.
        self.kv_bound = bool(out.preempted)
        if not out.preempted:
            j = 0
            while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[j]
                if seq.wait_for is not None and not self._prompt_cached(seq.wait_for):
                    j += 1
                    continue
                computed_blocks, num_cached = bm.get_computed_blocks(seq)
                num_new = min(seq.num_tokens - num_cached, budget)
                if not bm.allocate_slots(seq, num_new, computed_blocks):
                    self.kv_bound = True
                    break  # FCFS: a blocked head blocks the queue
                seq.num_computed_tokens = seq.num_cached_tokens = num_cached
                if seq.first_cached_tokens is None:  # resumed output tokens are not prompt tokens
                    seq.first_cached_tokens = min(num_cached, seq.num_prompt_tokens)
                seq.wait_for = None
                del self.waiting[j]
                seq.status = SequenceStatus.RUNNING
                bisect.insort(self.running, seq, key=lambda s: s.sort_key)
                out.num_scheduled_tokens[seq] = num_new
                budget -= num_new
        return out

    @staticmethod
    def _prompt_cached(parent: Sequence) -> bool:
        return parent.status is SequenceStatus.FINISHED or parent.num_computed_tokens >= parent.num_prompt_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._left.append(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        self.num_preemptions += 1
        self.add(seq)

    def update_from_output(self, out: SchedulerOutput) -> list[Sequence]:
        """Advance computed tokens once a step is launched; return the sequences
        that caught up (each sampled a token, pending until ``append_token``)."""
        caught_up = []
        for seq, n in out.num_scheduled_tokens.items():
            computed = seq.num_computed_tokens + n
            seq.num_computed_tokens = computed
            if computed == len(seq.token_ids) + seq.num_pending_tokens:
                seq.num_pending_tokens += 1
                caught_up.append(seq)
        return caught_up

    def append_tokens(self, seqs: list[Sequence], token_ids: list[int]) -> list[tuple[int, Sequence]]:
        """``append_token`` for a step's sampled tokens (row i of ``token_ids`` is ``seqs[i]``'s);
        returns (row, sequence) for those appended."""
        accepted = []
        finished = SequenceStatus.FINISHED
        for i, seq in enumerate(seqs):
            seq.num_pending_tokens -= 1
            if seq.status is not finished:
                seq.token_ids.append(token_ids[i])
                accepted.append((i, seq))
        return accepted

    def append_token(self, seq: Sequence, token_id: int) -> bool:
        """A sampled token reached the host. False (and nothing appended) when seq
        ended while the token was on its way: it is dropped."""
        seq.num_pending_tokens -= 1
        if seq.status is SequenceStatus.FINISHED:
            return False
        seq.token_ids.append(token_id)
        return True
