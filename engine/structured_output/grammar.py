"""One request's matcher: the grammar state after the output tokens accepted so far.

The engine calls ``accept_tokens`` with each step's sampled tokens, ``fill_bitmask`` for
the next step's row, and ``advance_to`` when the output it holds changed under the matcher
(a resume that re-prefills tokens generated elsewhere, a preemption by recompute, a
rollback of tokens the engine dropped): the matcher is re-advanced over exactly the output
tokens the sequence keeps, so the text it finishes still conforms.

Each call into xgrammar made here (a token's accept, a row's fill) is timed and handed to ``charge`` (the
manager's budget, see manager.py): an ambiguous grammar's matcher can cost more per token the
longer the output grows, and the engine ends a request whose constraint costs more than its bounds.
``cost`` keeps the last such call's time: the manager steps the matchers whose last call was cheap all
at once (``accept``/``fill_bitmask`` there, xgrammar's batch calls) and these one by one, timed.
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
    __slots__ = ("_matcher", "vocab_size", "accepted", "_charge", "request_id", "cost", "terminated", "_stop")

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int, charge: Charge | None = None,
                 request_id: str | None = None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.accepted: list[int] = []  # output tokens the matcher has taken, in order
        self._charge = charge
        self.request_id = request_id
        # the thread CPU seconds of the last timed call into the matcher (None: none yet, or to be timed again)
        self.cost: float | None = None
        # the matcher took a stop token (kept here: asking xgrammar is a call per row and step). A stop token
        # is taken only after a complete match, and nothing after it, so this is "the last accepted is one"
        self.terminated = False
        self._stop = frozenset(matcher.stop_token_ids)

    def took(self, token: int) -> None:
        """Record ``token`` as accepted by the matcher (the manager's batch accept said so)."""
        self.accepted.append(token)
        if token in self._stop:
            self.terminated = True

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
            if self.terminated or not (0 <= t < self.vocab_size):
                return False
            if charge is None:
                if not self._matcher.accept_token(t):
                    return False
                self.took(t)
                continue
            t0 = thread_time()
            ok = self._matcher.accept_token(t)
            self.cost = seconds = thread_time() - t0
            within = charge(seconds, k < last)
            if not ok:
                return False
            self.took(t)
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
        self.terminated = bool(self.accepted) and self.accepted[-1] in self._stop

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
        self.cost = seconds = thread_time() - t0
        self._charge(seconds, False)

    def is_terminated(self) -> bool:
        """The grammar reached its end and took a stop token: the request finishes with ``"stop"``."""
        return self.terminated

    def is_completed(self) -> bool:
        """The text so far is a complete match (a stop token may come next)."""
        return self._matcher.is_completed()

    def reset(self) -> None:
        self._matcher.reset()
        self.accepted.clear()
        self.terminated = False
