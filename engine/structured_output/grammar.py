"""One request's matcher: the grammar state after the output tokens accepted so far.

The engine calls ``accept_tokens`` with each step's sampled tokens, ``fill_bitmask`` for
the next step's row, and ``advance_to`` when the output it holds changed under the matcher
(a resume that re-prefills tokens generated elsewhere, a preemption by recompute, a
rollback of tokens the engine dropped): the matcher is re-advanced over exactly the output
tokens the sequence keeps, so the text it finishes still conforms.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class StructuredOutputGrammar:
    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.accepted: list[int] = []  # output tokens the matcher has taken, in order

    @property
    def num_processed_tokens(self) -> int:
        return len(self.accepted)

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over ``token_ids``; False (and the matcher left where it was before the first
        refused token) when one is not allowed. After termination nothing more is taken."""
        for t in token_ids:
            if self._matcher.is_terminated() or not (0 <= t < self.vocab_size) or not self._matcher.accept_token(t):
                return False
            self.accepted.append(t)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > len(self.accepted):
            raise ValueError(f"cannot roll back {num_tokens} tokens: the matcher holds {len(self.accepted)}")
        self._matcher.rollback(num_tokens)
        del self.accepted[-num_tokens:]

    def advance_to(self, output_token_ids: Sequence[int]) -> bool:
        """Bring the matcher to the state after ``output_token_ids``: roll back to the common
        prefix with what it accepted, accept the rest. False if the tokens do not conform (a
        resumed job whose earlier tokens were generated without this constraint)."""
        common = 0
        for a, b in zip(self.accepted, output_token_ids):
            if a != b:
                break
            common += 1
        if common < len(self.accepted):
            self.rollback(len(self.accepted) - common)
        return self.accept_tokens(output_token_ids[common:])

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit set = allowed).
        A terminated matcher allows only its stop tokens (the engine finishes the request first)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """The grammar reached its end and took a stop token: the request finishes with ``"stop"``."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """The text so far is a complete match (a stop token may come next)."""
        return self._matcher.is_completed()

    def reset(self) -> None:
        self._matcher.reset()
        self.accepted.clear()
