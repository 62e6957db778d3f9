"""The engine's side of structured outputs: compile a request's constraint when it arrives,
tell the scheduler whether its grammar is ready (a request waits for it without holding
any other back), keep one matcher per sequence (each of ``n`` samples walks the grammar on
its own) and build a step's bitmask for the rows that are constrained.

Nothing here runs on the device: ``fill_bitmask`` writes a host tensor the sampler applies.

The matchers' work is bounded per request (issue 37): an ambiguous grammar (``a ::= a a a | a a | "x" |
""``) makes xgrammar's Earley parser cost more per token as the output grows (0.1 ms to 315 ms by token
200), and the step's host work is every neighbour's wait. Each matcher call's thread CPU time (not wall
time: a host under load or a throttled container must not end requests) is charged to its sequence's
step and to its request's total; a request over ``step_budget_s`` (one sequence's work in one step) or
``request_budget_s`` (all its sequences' work) is listed in ``over_budget`` with the message it ends with,
and the engine ends it (the same path as a grammar that cannot compile). 0 turns a bound off.

A step's work is done in two batch calls, not two Python calls per sequence (issue 23, acceptance 5): every
sequence's new token in one ``xgr.BatchGrammarMatcher.batch_accept_token`` (``accept``) and every row of the
mask in one ``batch_fill_next_token_bitmask`` over ``batch_threads`` threads (``fill_bitmask``). A batch call
times all its rows together, so the budget splits its time evenly among them, and a matcher is batched only
while its last call timed on its own was cheap (``cost`` at most a 16th of the step bound): each matcher's
first call, a catch-up (a resume, a rollback) and any call after a batch call that took over a quarter of the
step bound are made one by one and timed, so a matcher that grows costly is found (and ended) by its own time
within a step of its batch growing slow.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch
import xgrammar as xgr

from pagestream.engine.structured_output.backend_xgrammar import StructuredOutputError, XgrammarBackend
from pagestream.engine.structured_output.bitmask import allocate_bitmask
from pagestream.engine.structured_output.grammar import StructuredOutputGrammar
from pagestream.engine.structured_output.params import StructuredOutputsParams

try:  # xgrammar's binding itself: its wrapper reads the result back one ffi call a row (~0.6 us each)
    from xgrammar.matcher import _core as _xgr_core

    _batch_accept_token = _xgr_core.BatchGrammarMatcher.batch_accept_token
except (ImportError, AttributeError):  # pragma: no cover - another xgrammar layout: the public wrapper
    _batch_accept_token = None


@dataclass(slots=True)
class _Pending:
    future: Future
    submitted: float  # time.monotonic() of the submit: the compile timeout counts from here


class StructuredOutputManager:
    """Grammars of one engine. The xgrammar backend (its tokenizer table takes ~0.2 s to build)
    is made on the first constrained request, so an engine that never sees one pays nothing."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: list[int] | None = None,
                 max_threads: int = 4, cache_size: int = 256, compile_timeout_s: float = 60.0,
                 pin_memory: bool = False, step_budget_s: float = 0.05, request_budget_s: float = 10.0,
                 batch_threads: int = 1) -> None:
        self._backend_args = dict(stop_token_ids=stop_token_ids, max_threads=max_threads, cache_size=cache_size,
                                  compile_timeout_s=compile_timeout_s)
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend: XgrammarBackend | None = None
        self._pending: dict[str, _Pending] = {}
        self._compiled: dict[str, Any] = {}
        self._grammars: dict[str, StructuredOutputGrammar] = {}  # seq_id -> matcher
        self._bitmask: torch.Tensor | None = None
        # pinned on CUDA: the copy to the device is then truly asynchronous (from pageable memory the
        # driver may wait for the stream, i.e. for the forward pass the mask was filled beside)
        self._pin_memory = pin_memory
        # the budget of the matchers' work (see the module's doc)
        self.step_budget_s = step_budget_s
        self.request_budget_s = request_budget_s
        self._step = 0  # begin_step() counts the engine's steps: a sequence's work within one is summed
        self._step_spent: dict[str, tuple[int, float]] = {}  # seq_id -> (step, seconds in it)
        self._request_spent: dict[str, float] = {}  # request_id -> seconds, all its sequences
        self.over_budget: dict[str, str] = {}  # request_id -> the error it ends with
        self._grammar_s = 0.0
        self._budget_errors = 0
        # the batch calls (see the module's doc): a matcher whose last call timed alone took at most cheap_s is
        # batched; a batch call over watch_s has each of its matchers timed alone again at its next call
        self.batch_threads = batch_threads
        self._batch: xgr.BatchGrammarMatcher | None = None
        if step_budget_s:
            self._watch_s = step_budget_s / 4
        else:
            self._watch_s = 0.0125 if request_budget_s else float("inf")
        self._cheap_s = self._watch_s / 4

    @property
    def backend(self) -> XgrammarBackend:
        if self._backend is None:
            self._backend = XgrammarBackend(self._tokenizer, self.vocab_size, **self._backend_args)
        return self._backend

    # ---- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Start compiling (or take the cached grammar); returns at once."""
        self._pending[request_id] = _Pending(self.backend.submit(params), time.monotonic())

    def is_ready(self, request_id: str) -> bool:
        """True once the grammar is compiled; False while it compiles. Raises
        ``StructuredOutputError`` (the compiler's message, or the timeout) when it cannot be:
        the engine finishes that request with the error and carries on."""
        if request_id in self._compiled:
            return True
        pending = self._pending.get(request_id)
        if pending is None:
            raise KeyError(f"request {request_id!r} has no structured output")
        backend = self.backend
        if not pending.future.done():
            if time.monotonic() - pending.submitted < backend.compile_timeout_s:
                return False
            del self._pending[request_id]
            raise StructuredOutputError(f"the grammar did not compile within {backend.compile_timeout_s:g} s")
        del self._pending[request_id]
        self._compiled[request_id] = backend.result(pending.future)  # raises the compile error
        return True

    def grammar(self, seq_id: str, request_id: str) -> StructuredOutputGrammar:
        """The sequence's matcher, made from its request's compiled grammar on first use."""
        g = self._grammars.get(seq_id)
        if g is None:
            compiled = self._compiled.get(request_id)
            if compiled is None:
                raise RuntimeError(f"request {request_id!r}: grammar used before is_ready() said so")
            g = self._grammars[seq_id] = StructuredOutputGrammar(
                self.backend.matcher(compiled), self.vocab_size, functools.partial(self._charge, seq_id, request_id),
                request_id)
        return g

    @property
    def num_grammars(self) -> int:
        """Sequences with a matcher now."""
        return len(self._grammars)

    def free_sequence(self, seq_id: str) -> None:
        self._grammars.pop(seq_id, None)
        self._step_spent.pop(seq_id, None)

    def free_request(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._compiled.pop(request_id, None)
        self._request_spent.pop(request_id, None)
        self.over_budget.pop(request_id, None)

    # ---- the budget ------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new engine step: each sequence's per-step account starts again."""
        self._step += 1

    def _charge(self, seq_id: str, request_id: str, seconds: float, own_step: bool) -> bool:
        """Add one matcher call's time to its sequence's step and its request's total; False once the
        request is over a bound (then ``over_budget[request_id]`` says which)."""
        self._grammar_s += seconds
        total = self._request_spent.get(request_id, 0.0) + seconds
        self._request_spent[request_id] = total
        if own_step:  # a token of a catch-up: one step's worth of work on its own
            step_s = seconds
        else:
            step, before = self._step_spent.get(seq_id, (-1, 0.0))
            step_s = before + seconds if step == self._step else seconds
            self._step_spent[seq_id] = (self._step, step_s)
        if request_id in self.over_budget:
            return False
        if self.step_budget_s and step_s > self.step_budget_s:
            error = (f"structured output grammar took {step_s * 1e3:.0f} ms in one step "
                     f"(limit {self.step_budget_s * 1e3:g} ms): the constraint is too costly to follow")
        elif self.request_budget_s and total > self.request_budget_s:
            error = (f"structured output grammar took {total:.1f} s in all "
                     f"(limit {self.request_budget_s:g} s): the constraint is too costly to follow")
        else:
            return True
        self.over_budget[request_id] = error
        self._budget_errors += 1
        return False

    def _charge_batch(self, grammars: list[StructuredOutputGrammar], seconds: float) -> None:
        """One batch call's time: an even share to each of its requests' totals; over ``watch_s``, each of
        its matchers is timed alone at its next call (one of them may have grown costly)."""
        self._grammar_s += seconds
        if seconds > self._watch_s:
            for g in grammars:
                g.cost = None
        limit = self.request_budget_s
        if not limit:
            return
        share = seconds / len(grammars)
        spent = self._request_spent
        for g in grammars:
            rid = g.request_id
            total = spent.get(rid, 0.0) + share
            spent[rid] = total
            if total > limit and rid not in self.over_budget:
                self.over_budget[rid] = (f"structured output grammar took {total:.1f} s in all "
                                         f"(limit {limit:g} s): the constraint is too costly to follow")
                self._budget_errors += 1

    # ---- the step's tokens -----------------------------------------------------------------------

    def accept(self, grammars: list[StructuredOutputGrammar], tokens: list[int]) -> list[StructuredOutputGrammar]:
        """Each of ``grammars`` takes its one new token (``tokens``, in order): the cheap ones in one batch
        call, the rest one by one (see the module's doc). Returns the grammars that refused their token
        (or went over their budget taking it), left where they were."""
        batch: list[StructuredOutputGrammar] = []
        batch_tokens: list[int] = []
        refused = []
        vocab = self.vocab_size
        for g, t in zip(grammars, tokens):
            if g.terminated:
                refused.append(g)
            elif g.cost is not None and g.cost <= self._cheap_s and 0 <= t < vocab:
                batch.append(g)
                batch_tokens.append(t)
            elif not g.accept_tokens((t,)):
                refused.append(g)
        if batch:
            t0 = perf_counter()
            if _batch_accept_token is not None:
                res = _batch_accept_token([g._matcher._handle for g in batch], batch_tokens, False)
                ok = None if 0 not in res else [bool(x) for x in res]  # one call when all took theirs
            else:
                ok = xgr.BatchGrammarMatcher.batch_accept_token([g._matcher for g in batch], batch_tokens)
            self._charge_batch(batch, perf_counter() - t0)
            if ok is None:
                for g, t in zip(batch, batch_tokens):
                    g.took(t)
            else:
                for g, t, took in zip(batch, batch_tokens, ok):
                    if took:
                        g.took(t)
                    else:
                        refused.append(g)
            over = self.over_budget
            if over:
                refused += [g for g in batch if g.request_id in over]
        return refused

    # ---- the step's mask -------------------------------------------------------------------------

    def fill_bitmask(self, rows: Sequence[StructuredOutputGrammar | None]) -> tuple[torch.Tensor, list[int]]:
        """The bitmask of one step: row i from ``rows[i]``'s matcher, unconstrained rows (None) left
        all-allowed and not listed, and so are the rows of a terminated matcher (its request is done) and of
        a request over its budget (it ends this step). The cheap matchers' rows are filled in one batch call
        (see the module's doc). Returns (bitmask [len(rows), words] int32 host, constrained row indices).
        The tensor is reused across steps: the caller makes sure the last one was copied to the device
        before the next call (the engine waits for the step it was applied in)."""
        n = len(rows)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = allocate_bitmask(max(n, 2 * (0 if self._bitmask is None else self._bitmask.shape[0])),
                                             self.vocab_size, pin_memory=self._pin_memory)
        bitmask = self._bitmask[:n]
        constrained = []
        batch: list[StructuredOutputGrammar] = []
        batch_rows: list[int] = []
        cheap = self._cheap_s
        over = self.over_budget
        for i, g in enumerate(rows):
            if g is None or g.terminated or (over and g.request_id in over):
                continue
            constrained.append(i)
            if g.cost is not None and g.cost <= cheap:
                batch.append(g)
                batch_rows.append(i)
            else:
                g.fill_bitmask(bitmask, i)
        if batch:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(self.batch_threads)
            t0 = perf_counter()
            self._batch.batch_fill_next_token_bitmask([g._matcher for g in batch], bitmask, batch_rows)
            self._charge_batch(batch, perf_counter() - t0)
        return bitmask, constrained

    def stats(self) -> dict[str, float]:
        s = self._backend.stats if self._backend is not None else None
        return {
            "structured_compilations": s.compilations if s else 0,
            "structured_cache_hits": s.cache_hits if s else 0,
            "structured_compile_errors": s.compile_errors if s else 0,
            "structured_compile_s": s.compile_s if s else 0.0,
            "structured_grammar_s": self._grammar_s,  # the matchers' host time, all requests (CPU; a batch call: wall)
            "structured_budget_errors": self._budget_errors,  # requests ended over their budget
        }

    def shutdown(self) -> None:
        if self._backend is not None:
            self._backend.shutdown()
