"""One request's matcher: the grammar state after the output tokens accepted so far.

The engine calls ``accept_tokens`` with each step's sampled tokens, ``fill_bitmask`` for
the next step's row, and ``advance_to`` when the output it holds changed under the matcher
(a resume that re-prefills tokens generated elsewhere, a preemption by recompute, a
rollback of tokens the engine dropped): the matcher is re-advanced over exactly the output
tokens the sequence keeps, so the text it finishes still conforms.

Each call into xgrammar (a token's accept, a row's fill) is timed and handed to ``charge`` (the
manager's budget, see manager.py): an ambiguous grammar's matcher can cost more per token the
longer the output grows, and the engine ends a request whose constraint costs more than its bounds.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from time import thread_time

import torch
import xgrammar as xgr


#: ``charge(seconds, own_step)`` is told the host time of each call into the matcher; ``own_step``: a token
#: of a catch-up (a resume, a rollback) that is not the last, so its cost is a step of its own. It returns
#: False once the request is over its budget.
Charge = Callable[[float, bool], bool]


class StructuredOutputGrammar:
    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int, charge: Charge | None = None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.accepted: list[int] = []  # output tokens the matcher has taken, in order
        self._charge = charge

    @property
    def num_processed_tokens(self) -> int:
        return len(self.accepted)

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over ``token_ids``; False (and the matcher left where it was before the first
        refused token) when one is not allowed. After termination nothing more is taken. Also False,
        after the token that went over it, once the request is over its budget (see ``charge``)."""
        charge = self._charge
        last = len(token_ids) - 1
        for k, t in enumerate(token_ids):
            if self._matcher.is_terminated() or not (0 <= t < self.vocab_size):
                return False
            if charge is None:
                if not self._matcher.accept_token(t):
                    return False
                self.accepted.append(t)
                continue
            t0 = thread_time()
            ok = self._matcher.accept_token(t)
            within = charge(thread_time() - t0, k < last)
            if not ok:
                return False
            self.accepted.append(t)
            if not within:
                return False
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
        if self._charge is None:
            self._matcher.fill_next_token_bitmask(bitmask, row)
            return
        t0 = thread_time()
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._charge(thread_time() - t0, False)

    def is_terminated(self) -> bool:
        """The grammar reached its end and took a stop token: the request finishes with ``"stop"``."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """The text so far is a complete match (a stop token may come next)."""
        return self._matcher.is_completed()

    def reset(self) -> None:
        self._matcher.reset()
        self.accepted.clear()
