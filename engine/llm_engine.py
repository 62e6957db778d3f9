"""The engine's step: requests in, incremental outputs out.

``EngineCore`` is the engine proper (scheduler, model runner, grammars): it runs requests that are
already checked and tokenized, and its ``step()`` reports token ids (and logprobs when asked, finish
reasons, errors) as the typed messages of engine/core_messages.py. It knows no text: stop strings,
``output_kind``, logprob merging and abort outputs are the ``OutputProcessor``'s
(engine/output_processor.py).

``LLMEngine`` (below) is that core plus the ``OutputProcessor``, in one process: the one engine API
the worker uses in-process and what ``LLM`` drives. engine/core_process.py runs the same core in a
process of its own, and ``EngineProcess`` puts the same ``OutputProcessor`` on the caller's side.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagestream.engine.block_manager import BlockManager
from pagestream.engine.config import EngineConfig
from pagestream.engine.core_messages import EngineCoreError, ErrorType, RequestDelta, SampleDelta, TokenBatch
from pagestream.engine.heap import freeze_startup_heap
from pagestream.engine.input_processor import ChatRequests, EngineLimits, InputProcessor
from pagestream.engine.output_processor import OutputProcessor
from pagestream.engine.outputs import ITERATION_TOKENS_KEPT, EngineStats, RequestOutput
from pagestream.engine.sampling_params import SamplingParams
from pagestream.engine.scheduler import Scheduler
from pagestream.engine.sequence import Sequence, SequenceStatus
from pagestream.engine.tokenizer import eos_token_ids, load_tokenizer

if TYPE_CHECKING:
    from pagestream.engine.model_runner import StepHandle

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _CoreRequest:
    rid: int | str  # the caller's key for it, as the core's outputs carry it
    params: SamplingParams
    seqs: list[Sequence]
    # one sample and no logprobs: a token that does not end it goes out in the step's TokenBatch
    plain: bool
    cumulative_logprob: list[float]  # per sample
    # asked-for prompt logprobs so far ([None] for the first token, then a dict per token); None once reported
    prompt_logprobs: list | None = None

    @property
    def num_cached_tokens(self) -> int | None:  # the first sample's prefix-cache hit, once scheduled
        return self.seqs[0].first_cached_tokens

    @property
    def key(self) -> str:  # the sequences' request_id
        return self.seqs[0].request_id

    @property
    def finished(self) -> bool:
        for s in self.seqs:
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True


class EngineCore:
    """Continuous batching over a paged KV cache, in token ids.

    ``add_request`` takes a request ``InputProcessor.process`` has checked; ``step`` runs one
    forward pass and returns the token ids it produced as ``TokenBatch`` / ``RequestDelta``
    messages. The caller ends samples it has seen a stop string in with ``finish_sample``, and
    requests with ``abort_request``; neither produces an output (the caller writes those).
    """

    def __init__(self, config: EngineConfig) -> None:
        from pagestream.engine.model_runner import ModelRunner  # torch lives below this line

        self.config = config
        self.tokenizer = load_tokenizer(self.config.tokenizer_path)  # the grammars' vocabulary
        self.eos_token_ids = eos_token_ids(self.config, self.tokenizer)
        self.runner = ModelRunner(self.config, self.eos_token_ids)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.config.max_model_len
        )
        self.vocab_size = self.runner.vocab_size
        self.limits = EngineLimits(self.vocab_size, self.config.max_model_len, self.config.max_num_seqs,
                                   self.config.block_size, self.block_manager.num_blocks, self.config.enable_prefix_caching)
        self._requests: dict[str, _CoreRequest] = {}  # by the sequences' request_id, str(rid)
        self._arrival = itertools.count()
        self.num_generated_tokens = 0
        # tokens each step since the last take_iteration_tokens() scheduled (prompt chunks + decodes); bounded, for a
        # caller that never takes them (the offline LLM)
        self._iteration_tokens: deque[int] = deque(maxlen=ITERATION_TOKENS_KEPT)
        # The step on the device whose sampled tokens the host has not read yet.
        self._in_flight: StepHandle | None = None
        # Live requests whose sampling reads the token history (penalties): while any
        # runs, each step waits for the one before it (see step()).
        self._num_history_requests = 0
        # structured outputs: the manager (made on the first constrained request) and the requests
        # whose grammar is still compiling, held out of the scheduler so nobody else waits for them
        self._structured = None
        self._awaiting_grammar: dict[str, _CoreRequest] = {}
        self.runner.warm_up()
        freeze_startup_heap()
        from pagestream.engine.structured_output import warm_up_backend

        self.grammar_warm_up = warm_up_backend(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def step_in_flight(self) -> bool:
        """A launched step whose tokens the host has not read yet."""
        return self._in_flight is not None

    # ---- input -------------------------------------------------------------------
    def add_request(self, rid: int | str, ids: list[int], resume: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        """Queue a request that ``InputProcessor.process`` has already checked and tokenized, under the
        caller's key ``rid``. ``resume`` are output tokens already produced (by a worker that died):
        they are re-prefilled and count toward max_tokens. The core reads neither ``params.stop`` nor
        ``params.output_kind``."""
        request_id = str(rid)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        arrival = next(self._arrival)
        seqs = []
        for i in range(params.n):
            seq = Sequence(
                seq_id=f"{request_id}#{i}",
                request_id=request_id,
                sample_index=i,
                token_ids=ids + resume,
                num_prompt_tokens=len(ids),
                params=params,
                arrival_order=arrival,
                priority=priority,
                wait_for=seqs[0] if i > 0 and self.config.enable_prefix_caching else None,
            )
            seqs.append(seq)
        req = _CoreRequest(rid, params, seqs, params.n == 1 and params.logprobs is None and params.prompt_logprobs is None,
                           [0.0] * params.n, [None] if params.prompt_logprobs is not None else None)
        if params.structured_outputs is not None:
            self.structured_outputs.add_request(request_id, params.structured_outputs)
        self._requests[request_id] = req
        self._num_history_requests += self._reads_history(params)
        if params.structured_outputs is not None:
            self._awaiting_grammar[request_id] = req
            return
        for seq in seqs:
            self.scheduler.add(seq)

    @staticmethod
    def _reads_history(params: SamplingParams) -> bool:
        # penalties read the token history on the host: their steps run synchronously. A grammar's
        # mask needs the tokens before it too, but only at the sampler: the runner waits for the
        # step in flight there, with the next forward pass already queued (see _grammar_rows)
        return params.uses_penalties

    @property
    def structured_outputs(self):
        """The grammars of this engine (xgrammar), made on first use."""
        if self._structured is None:
            from pagestream.engine.structured_output.manager import StructuredOutputManager

            self._structured = StructuredOutputManager(self.tokenizer, self.vocab_size,
                                                       stop_token_ids=sorted(self.eos_token_ids),
                                                       pin_memory=self.runner.device.type == "cuda",
                                                       step_budget_s=self.config.grammar_step_limit_ms / 1e3,
                                                       request_budget_s=self.config.grammar_request_limit_s)
            self.runner.grammar_rows = self._grammar_rows
        return self._structured

    def _grammar_rows(self, seqs: list[Sequence], prev: StepHandle | None = None):
        """The step's bitmask for the constrained ones among ``seqs``, each matcher brought to the
        output its sequence holds plus the token ``prev`` (the step still in flight) sampled for it:
        in the common case one new token a sequence, all taken in one batch call (the manager's
        ``accept``); after a preemption or a resume, a re-advance.

        Called by the runner with this step's forward pass queued: waiting for ``prev`` here lets the
        device run it meanwhile (asynchronous scheduling stays on). A sequence ``prev`` ended (EOS,
        grammar terminated, stop) still has a row this step; its matcher is terminated, so the row is
        left unconstrained, and the token is dropped when ``prev`` is read.

        A request whose grammar went over its budget gets no more matcher work: its row is left
        unconstrained and ``step()`` ends it right after this launch, so that token is never read."""
        manager = self._structured
        over_budget = manager.over_budget
        rows = None
        pending = None
        new_g: list = []
        new_t: list[int] = []
        for i, seq in enumerate(seqs):
            if seq.params.structured_outputs is None:
                continue
            if rows is None:
                rows = [None] * len(seqs)
                if prev is not None:
                    # also orders this fill after the copy of the last mask (its buffer is reused)
                    pending = prev.result().token_ids
            if over_budget and seq.request_id in over_budget:
                continue
            g = manager.grammar(seq.seq_id, seq.request_id)
            rows[i] = g
            toks = seq.token_ids
            start = seq.num_prompt_tokens
            n = len(toks) - start  # output tokens, the one in flight counted below
            new = None
            if seq.num_pending_tokens and pending is not None and seq in prev.rows:
                new = pending[prev.rows[seq]]
                n += 1
            done = g.num_processed_tokens
            # the matcher's last token must be the output's at its place (else the output changed under it)
            if not done or (done <= n and g.accepted[-1] == (toks[start + done - 1] if start + done <= len(toks)
                                                              else new)):
                if done == n:
                    continue
                if done == n - 1:  # the common case: one new token
                    new_g.append(g)
                    new_t.append(new if new is not None else toks[-1])
                    continue
            out = toks[start:]
            if new is not None:
                out.append(new)
            if not g.advance_to(out) and seq.request_id not in over_budget:
                logger.warning("request %s: output tokens do not conform to its grammar", seq.request_id)
        if rows is None:
            return None
        if new_g:
            for g in manager.accept(new_g, new_t):
                if g.request_id not in over_budget:
                    logger.warning("request %s: output tokens do not conform to its grammar", g.request_id)
        return manager.fill_bitmask(rows)

    def _admit_compiled(self) -> list[RequestDelta]:
        """Move requests whose grammar compiled into the scheduler; end those whose cannot with its error."""
        failed = []
        for rid, req in list(self._awaiting_grammar.items()):
            try:
                if not self._structured.is_ready(rid):
                    continue
            except ValueError as exc:
                del self._awaiting_grammar[rid]
                for seq in req.seqs:  # the scheduler ends them, as it ends every sequence
                    self.scheduler.add(seq)
                    self.scheduler.finish(seq, "abort")
                failed.append(self._ended(req, str(exc)))
                self._forget(req)
                continue
            del self._awaiting_grammar[rid]
            for seq in req.seqs:
                self.scheduler.add(seq)
        return failed

    def _end_over_budget(self) -> list[RequestDelta]:
        """End the requests whose grammar went over its budget (``StructuredOutputManager.over_budget``)
        with its error, as a grammar that cannot compile ends its request: blocks freed, samples 'abort'."""
        over_budget = self._structured.over_budget
        ended = []
        for rid, error in list(over_budget.items()):
            req = self._requests.get(rid)
            if req is None:  # finished meanwhile (its last token was read)
                del over_budget[rid]
                continue
            logger.warning("request %s: %s", rid, error)
            for seq in req.seqs:
                self.scheduler.finish(seq, "abort")
            ended.append(self._ended(req, error))
            self._forget(req)
        return ended

    @staticmethod
    def _ended(req: _CoreRequest, error: str) -> RequestDelta:
        """The message for a request that failed in the core (its samples end with 'abort')."""
        lps = [] if req.params.logprobs is not None else None
        samples = [SampleDelta(i, [], 0.0 if lps is not None else None, lps, seq.finish_reason, seq.stop_reason)
                   for i, seq in enumerate(req.seqs)]
        return RequestDelta(req.rid, True, EngineCoreError(ErrorType.REQUEST, error), None, samples,
                            num_cached_tokens=req.num_cached_tokens)

    def abort_request(self, rid: int | str) -> bool:
        """Stop a request now and free its blocks (its caller writes the 'abort' output)."""
        req = self._requests.get(str(rid))
        if req is None:
            return False
        if self._awaiting_grammar.pop(req.key, None) is not None:
            for seq in req.seqs:  # never scheduled: the scheduler ends them, as it ends every sequence
                self.scheduler.add(seq)
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        self._forget(req)
        return True

    def finish_sample(self, rid: int | str, index: int, stop_reason: str | None) -> None:
        """End one sample as stopped (a stop string its caller found) and free its blocks."""
        req = self._requests.get(str(rid))
        if req is None or req.seqs[index].is_finished:
            return
        self.scheduler.finish(req.seqs[index], "stop", stop_reason)
        if req.finished:
            self._forget(req)

    def _forget(self, req: _CoreRequest) -> None:
        key = req.key
        del self._requests[key]
        self._num_history_requests -= self._reads_history(req.params)
        if req.params.structured_outputs is not None and self._structured is not None:
            self._structured.free_request(key)
            for seq in req.seqs:
                self._structured.free_sequence(seq.seq_id)

    # ---- the step ------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._in_flight is not None

    def num_admittable(self) -> int:
        """How many more requests the engine takes now: up to ``max_num_seqs`` sequences running or
        waiting, and none while the KV pool is what holds the waiting ones back. Requests that wait
        only for the token budget (a burst of prompts prefilled over several steps) belong in the
        engine: the scheduler starts each as soon as the budget allows, with no round trip to the queue."""
        sched = self.scheduler
        if sched.waiting and sched.kv_bound:
            return 0
        return max(0, self.config.max_num_seqs - len(sched.running) - len(sched.waiting))

    def step(self) -> list[RequestDelta | TokenBatch]:
        """Plan and launch step N+1, then read step N's tokens while N+1 runs.

        The host's work for a step (scheduling, inputs, detokenization, stop checks,
        outputs) overlaps the device's: step N+1 is planned counting N's tokens as
        known, takes them from the device, and the sequences N ended are dropped from
        N+1's results. Outputs therefore come one step after their forward pass.
        With ``async_scheduling=False``, or while a request with penalties runs (its
        sampling reads the host's token history), step N is read before N+1 is planned.
        """
        outputs: list[RequestDelta | TokenBatch] = []
        structured = self._structured
        if structured is not None:
            structured.begin_step()
        if self._awaiting_grammar:
            outputs += self._admit_compiled()
        prev = self._in_flight
        self._in_flight = None
        if prev is not None and (not self.config.async_scheduling or self._num_history_requests):
            outputs += self._read_tokens(prev, accept_grammars=True)
            prev = None
        # a grammar over its budget (found reading tokens, or filling the mask below) ends its request
        # before its sequences are scheduled again
        if structured is not None and structured.over_budget:
            outputs += self._end_over_budget()
        sched = self.scheduler.schedule()
        if sched.left:
            self.runner.release_rows(sched.left)
        if not sched.is_empty:
            self._in_flight = self.runner.execute(sched, prev)
            self.scheduler.update_from_output(sched)
            self._iteration_tokens.append(sched.total_num_scheduled_tokens)
        if structured is not None and structured.over_budget:
            outputs += self._end_over_budget()
        if prev is not None:
            outputs += self._read_tokens(prev)
        return outputs

    def _read_tokens(self, step: StepHandle, accept_grammars: bool = False) -> list[RequestDelta | TokenBatch]:
        """Wait for a launched step's tokens, end the sequences they finish (EOS, stop token ids,
        lengths, a grammar's end) and report them: one ``TokenBatch`` for the single-sample requests
        without logprobs that go on, a ``RequestDelta`` for each other request. ``accept_grammars``: a
        synchronous step, whose constrained sequences' matchers take these tokens here, in one batch call
        (an asynchronous step's took them when the next step's mask was filled)."""
        if step.prompt_logprobs is not None:
            self._add_prompt_logprobs(step.prompt_logprobs.wait())
        sampled = step.result()
        # a loop over every sequence of the step: plain fields, no properties
        accepted = self.scheduler.append_tokens(step.seqs, sampled.token_ids)
        if not accepted:
            return []
        if accept_grammars and self._structured is not None and self._structured.num_grammars:
            self._accept_grammars(accepted)
        self.num_generated_tokens += len(accepted)
        requests = self._requests
        logprobs = sampled.logprobs if sampled.logprobs.count(None) < len(sampled.logprobs) else None
        finished = SequenceStatus.FINISHED
        rids: list = []
        token_ids: list[int] = []
        samples: dict[_CoreRequest, list[SampleDelta]] = {}  # the rest, per request
        for i, seq in accepted:
            req = requests[seq.request_id]
            token = seq.token_ids[-1]
            self._check_finish(seq, token)
            if req.plain and seq.status is not finished:
                rids.append(req.rid)
                token_ids.append(token)
                continue
            cumulative = lps = None
            if req.params.logprobs is not None:
                index = seq.sample_index
                lps = []
                if logprobs is not None and logprobs[i] is not None:
                    chosen, top = logprobs[i]
                    lps.append(top)
                    req.cumulative_logprob[index] += chosen
                cumulative = req.cumulative_logprob[index]
            delta = SampleDelta(seq.sample_index, [token], cumulative, lps, seq.finish_reason, seq.stop_reason)
            got = samples.get(req)
            if got is None:
                samples[req] = [delta]
            else:
                got.append(delta)
        outputs: list[RequestDelta | TokenBatch] = [TokenBatch(rids, token_ids)] if rids else []
        for req, deltas in samples.items():
            done = req.finished
            outputs.append(RequestDelta(req.rid, done, None, None, deltas, self._take_prompt_logprobs(req),
                                        req.num_cached_tokens))
            if done:
                self._forget(req)
        return outputs

    def _add_prompt_logprobs(self, chunks) -> None:
        """A step's chunks of prompt logprobs joined to their requests' (a chunk computed again after a
        preemption adds only what is new)."""
        for seq, first, lps in chunks:
            req = self._requests.get(seq.request_id)
            acc = req.prompt_logprobs if req is not None else None
            if acc is not None and first <= len(acc):
                acc.extend(lps[len(acc) - first:])

    @staticmethod
    def _take_prompt_logprobs(req: _CoreRequest) -> list | None:
        """The request's prompt logprobs once all are in (then never again), else None."""
        acc = req.prompt_logprobs
        if acc is None or len(acc) < req.seqs[0].num_prompt_tokens:
            return None
        req.prompt_logprobs = None
        return acc

    def _check_finish(self, seq: Sequence, token: int) -> None:
        p = seq.params
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        if p.structured_outputs is not None and self._grammar_terminated(seq, token):
            self.scheduler.finish(seq, "stop", None)
            return
        if num_output >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                self.scheduler.finish(seq, "stop", None)
                return
            if p.stop_token_ids and token in p.stop_token_ids:
                self.scheduler.finish(seq, "stop", token)
                return
        if (p.max_tokens is not None and num_output >= p.max_tokens) or num_tokens >= self.config.max_model_len:
            self.scheduler.finish(seq, "length")

    def _accept_grammars(self, accepted: list[tuple[int, Sequence]]) -> None:
        """The constrained sequences' matchers take the token each just got, in one batch call (a matcher
        that refuses is left behind and ``_grammar_rows`` says so when it re-advances)."""
        manager = self._structured
        over_budget = manager.over_budget
        grammars, tokens = [], []
        for _, seq in accepted:
            if seq.params.structured_outputs is None or (over_budget and seq.request_id in over_budget):
                continue
            g = manager.grammar(seq.seq_id, seq.request_id)
            if g.num_processed_tokens == len(seq.token_ids) - seq.num_prompt_tokens - 1:
                grammars.append(g)
                tokens.append(seq.token_ids[-1])
        if grammars:
            manager.accept(grammars, tokens)

    def _grammar_terminated(self, seq: Sequence, token: int) -> bool:
        """The grammar took ``token`` as its end (a stop token after a complete match): the request is done
        whatever ignore_eos says, since nothing more can follow."""
        if seq.request_id in self._structured.over_budget:
            return False  # no more matcher work: the request ends with its error this step
        g = self._structured.grammar(seq.seq_id, seq.request_id)
        if g.num_processed_tokens == len(seq.token_ids) - seq.num_prompt_tokens - 1:
            g.accept_tokens((token,))  # not taken yet (a step no mask followed): alone
        return g.terminated

    # ---- stats ----------------------------------------------------------------------
    def take_iteration_tokens(self) -> list[int]:
        """The tokens each step launched since the last call computed (prompt tokens, a chunk of a long
        prompt, one per decoding sequence), oldest first: vLLM's ``vllm:iteration_tokens_total``."""
        taken = list(self._iteration_tokens)
        self._iteration_tokens.clear()
        return taken

    def stats(self) -> EngineStats:
        bm = self.block_manager
        so = self._structured.stats() if self._structured is not None else {}
        return EngineStats(
            structured_compilations=so.get("structured_compilations", 0),
            structured_cache_hits=so.get("structured_cache_hits", 0),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            kv_usage=bm.usage,
            kv_waste=bm.waste(self.scheduler.running),
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_generated_tokens=self.num_generated_tokens,
            kv_bound=self.scheduler.kv_bound,
        )


class LLMEngine(ChatRequests):
    """Continuous-batching engine over a paged KV cache: an ``EngineCore`` and the
    ``OutputProcessor`` that turns its token ids into ``RequestOutput``s.

    ``add_request`` checks its input and raises ``ValueError`` on anything bad;
    ``step`` runs one forward pass and returns incremental ``RequestOutput``s.
    """

    def __init__(self, config: EngineConfig | None = None, *, detokenize: bool = True, **kwargs) -> None:
        """``detokenize=False``: outputs carry token ids only (no text, so no stop strings either)."""
        self.core = core = EngineCore(config if config is not None else EngineConfig(**kwargs))
        self.config = core.config
        self.tokenizer = core.tokenizer
        self.detokenize = detokenize
        self.limits = core.limits
        # the core's parts, for callers that look at them (benchmarks, tests, the worker's vocabulary check)
        self.runner, self.scheduler, self.block_manager = core.runner, core.scheduler, core.block_manager
        self.eos_token_ids, self.vocab_size = core.eos_token_ids, core.vocab_size
        self.inputs = InputProcessor(self.tokenizer, self.limits, self.config.model)
        self.output_processor = OutputProcessor(self.tokenizer if detokenize else None)
        self._aborted_outputs: list[RequestOutput] = []  # reported with the next step

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def structured_outputs(self):
        """The grammars of this engine (xgrammar), made on first use."""
        return self.core.structured_outputs

    @property
    def num_generated_tokens(self) -> int:
        return self.core.num_generated_tokens

    # ---- input -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        resume_token_ids: list[int] | None = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str | None = None,
    ) -> None:
        """Queue a request. ``resume_token_ids`` are output tokens already produced
        (by a worker that died): they are re-prefilled, count toward max_tokens, and
        their text counts as already emitted. ``truncate_prompt_tokens`` / ``truncation_side``:
        vLLM's, applied to the prompt's ids right after tokenizing (``InputProcessor.truncate``)."""
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        ids, resume, params = self.inputs.process(prompt, params, prompt_token_ids, resume_token_ids,
                                                  truncate_prompt_tokens, truncation_side)
        self.core.add_request(request_id, ids, resume, params, priority)
        self.output_processor.add_request(request_id, request_id, prompt, ids, resume, params)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output (finish_reason 'abort') comes
        with the next step."""
        out = self.output_processor.abort(request_id)
        if out is None:
            return False
        self.core.abort_request(request_id)
        self._aborted_outputs.append(out)
        return True

    # ---- the step ------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor) or bool(self._aborted_outputs) or self.core.has_unfinished_requests()

    def num_admittable(self) -> int:
        """As ``EngineCore.num_admittable``."""
        return self.core.num_admittable()

    def step(self) -> list[RequestOutput]:
        """``EngineCore.step`` (launch step N+1, read step N's token ids while N+1 runs), then those
        ids through the output processor while N+1 still runs. A sample a stop string ended is
        finished in the core here, before the next step is planned, so its blocks are free for it."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        core_outputs = self.core.step()
        if not core_outputs:
            return outputs
        done = self.output_processor.process(core_outputs)
        core = self.core
        for rid in done.aborts:
            core.abort_request(rid)
        for rid, index, stop_reason in done.stop_samples:
            core.finish_sample(rid, index, stop_reason)
        if outputs:
            outputs += done.outputs
            return outputs
        return done.outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    def take_iteration_tokens(self) -> list[int]:
        """The tokens each engine step computed since the last call (``EngineCore.take_iteration_tokens``)."""
        return self.core.take_iteration_tokens()
