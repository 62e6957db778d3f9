"""The engine's step: requests in, incremental outputs out. The one engine API the worker uses."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagestream.engine.block_manager import BlockManager
from pagestream.engine.config import EngineConfig
from pagestream.engine.heap import freeze_startup_heap
from pagestream.engine.detokenizer import IncrementalDetokenizer
from pagestream.engine.input_processor import EngineLimits, InputProcessor
from pagestream.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from pagestream.engine.sampling_params import SamplingParams
from pagestream.engine.scheduler import Scheduler
from pagestream.engine.sequence import Sequence, SequenceStatus
from pagestream.engine.tokenizer import eos_token_ids, load_tokenizer

if TYPE_CHECKING:
    from pagestream.engine.model_runner import StepHandle

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    arrival_time: float
    first_token_time: float | None = None
    # per sample: index of the first output token not yet reported, logprobs not yet reported
    reported: list[int] = field(default_factory=list)
    pending_logprobs: list[list[dict[int, float]]] = field(default_factory=list)
    cumulative_logprob: list[float] = field(default_factory=list)
    error: str | None = None  # why the request ended without output (a grammar that cannot compile)

    @property
    def finished(self) -> bool:
        for s in self.seqs:
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    ``add_request`` checks its input and raises ``ValueError`` on anything bad;
    ``step`` runs one forward pass and returns incremental ``RequestOutput``s.
    """

    def __init__(self, config: EngineConfig | None = None, *, detokenize: bool = True, **kwargs) -> None:
        """``detokenize=False``: outputs carry token ids only, and stop strings are the caller's
        (an engine core whose caller detokenizes, ``engine.engine_process``)."""
        from pagestream.engine.model_runner import ModelRunner  # torch lives below this line

        self.config = config if config is not None else EngineConfig(**kwargs)
        self.tokenizer = load_tokenizer(self.config.tokenizer_path)
        self.detokenize = detokenize
        self.eos_token_ids = eos_token_ids(self.config, self.tokenizer)
        self.runner = ModelRunner(self.config, self.eos_token_ids)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.config.max_model_len
        )
        self.vocab_size = self.runner.vocab_size
        self.limits = EngineLimits(self.vocab_size, self.config.max_model_len, self.config.max_num_seqs,
                                   self.config.block_size, self.block_manager.num_blocks, self.config.enable_prefix_caching)
        self.inputs = InputProcessor(self.tokenizer, self.limits, self.config.model)
        self._requests: dict[str, _Request] = {}
        self._arrival = itertools.count()
        self._aborted_outputs: list[RequestOutput] = []
        self.num_generated_tokens = 0
        # The step on the device whose sampled tokens the host has not read yet.
        self._in_flight: StepHandle | None = None
        # Live requests whose sampling reads the token history (penalties): while any
        # runs, each step waits for the one before it (see step()).
        self._num_history_requests = 0
        # structured outputs: the manager (made on the first constrained request) and the requests
        # whose grammar is still compiling, held out of the scheduler so nobody else waits for them
        self._structured = None
        self._awaiting_grammar: dict[str, _Request] = {}
        self.runner.warm_up()
        freeze_startup_heap()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- input -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        resume_token_ids: list[int] | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. ``resume_token_ids`` are output tokens already produced
        (by a worker that died): they are re-prefilled, count toward max_tokens, and
        their text counts as already emitted."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        ids, resume, params = self.inputs.process(prompt, params, prompt_token_ids, resume_token_ids)
        self.add_checked_request(request_id, prompt, ids, resume, params, priority)

    def add_checked_request(self, request_id: str, prompt: str | None, ids: list[int], resume: list[int],
                            params: SamplingParams, priority: int = 0) -> None:
        """Queue a request that ``InputProcessor.process`` has already checked and tokenized."""
        arrival = next(self._arrival)
        seqs, detoks = [], []
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
            detok = IncrementalDetokenizer(self.tokenizer if self.detokenize else None, params)
            for t in resume:
                detok.add_token(t)
            detok.take_delta(finished=False)  # text of resumed tokens counts as emitted
            seqs.append(seq)
            detoks.append(detok)
        req = _Request(request_id, prompt, ids, params, seqs, detoks, time.monotonic())
        req.reported = [len(resume)] * params.n
        req.pending_logprobs = [[] for _ in range(params.n)]
        req.cumulative_logprob = [0.0] * params.n
        self._requests[request_id] = req
        self._num_history_requests += self._reads_history(params)
        if params.structured_outputs is not None:
            self.structured_outputs.add_request(request_id, params.structured_outputs)
            self._awaiting_grammar[request_id] = req
            return
        for seq in seqs:
            self.scheduler.add(seq)

    @staticmethod
    def _reads_history(params: SamplingParams) -> bool:
        # penalties read the token history, and a grammar's mask needs the tokens before it: both
        # run their steps synchronously (the mask is filled on the host before the sampler runs)
        return params.uses_penalties or params.structured_outputs is not None

    @property
    def structured_outputs(self):
        """The grammars of this engine (xgrammar), made on first use."""
        if self._structured is None:
            from pagestream.engine.structured_output.manager import StructuredOutputManager

            self._structured = StructuredOutputManager(self.tokenizer, self.vocab_size,
                                                       stop_token_ids=sorted(self.eos_token_ids))
            self.runner.sampler.grammar_rows = self._grammar_rows
        return self._structured

    def _grammar_rows(self, seqs: list[Sequence]):
        """The step's bitmask for the constrained ones among ``seqs`` (their matchers brought to the
        output they hold: after a preemption or a resume that is a re-advance, else a no-op)."""
        manager = self._structured
        rows = None
        for i, seq in enumerate(seqs):
            if seq.params.structured_outputs is None:
                continue
            if rows is None:
                rows = [None] * len(seqs)
            g = manager.grammar(seq.seq_id, seq.request_id)
            out = seq.token_ids[seq.num_prompt_tokens:]
            if g.num_processed_tokens != len(out) or (out and g.accepted[-1] != out[-1]):
                if not g.advance_to(out):
                    logger.warning("request %s: output tokens do not conform to its grammar", seq.request_id)
            rows[i] = None if g.is_terminated() else g
        if rows is None:
            return None
        return manager.fill_bitmask(rows)

    def _admit_compiled(self) -> list[RequestOutput]:
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
                req.error = str(exc)
                failed.append(self._make_output(req))
                self._forget(req)
                continue
            del self._awaiting_grammar[rid]
            for seq in req.seqs:
                self.scheduler.add(seq)
        return failed

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.inputs.chat_token_ids(messages)

    def add_chat_request(self, request_id: str, messages: list[dict], params: SamplingParams | None = None, **kwargs) -> None:
        self.add_request(request_id, prompt_token_ids=self.apply_chat_template(messages), params=params, **kwargs)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output says 'abort'."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._awaiting_grammar.pop(request_id, None)
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        self._aborted_outputs.append(self._make_output(req))
        self._forget(req)
        return True

    def finish_sample(self, request_id: str, index: int, stop_reason: str | None) -> None:
        """End one sample as stopped (a stop string its caller found); the request's final
        output comes with the next step once every sample has ended."""
        req = self._requests.get(request_id)
        if req is None or req.seqs[index].is_finished:
            return
        self.scheduler.finish(req.seqs[index], "stop", stop_reason)
        if req.finished:
            self._aborted_outputs.append(self._make_output(req))
            self._forget(req)

    def _forget(self, req: _Request) -> None:
        del self._requests[req.request_id]
        self._num_history_requests -= self._reads_history(req.params)
        if req.params.structured_outputs is not None and self._structured is not None:
            self._structured.free_request(req.request_id)
            for seq in req.seqs:
                self._structured.free_sequence(seq.seq_id)

    # ---- the step ------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted_outputs) or self._in_flight is not None

    def num_admittable(self) -> int:
        """How many more requests the engine takes now: up to ``max_num_seqs`` sequences running or
        waiting, and none while the KV pool is what holds the waiting ones back. Requests that wait
        only for the token budget (a burst of prompts prefilled over several steps) belong in the
        engine: the scheduler starts each as soon as the budget allows, with no round trip to the queue."""
        sched = self.scheduler
        if sched.waiting and sched.kv_bound:
            return 0
        return max(0, self.config.max_num_seqs - len(sched.running) - len(sched.waiting))

    def step(self) -> list[RequestOutput]:
        """Plan and launch step N+1, then read step N's tokens while N+1 runs.

        The host's work for a step (scheduling, inputs, detokenization, stop checks,
        outputs) overlaps the device's: step N+1 is planned counting N's tokens as
        known, takes them from the device, and the sequences N ended are dropped from
        N+1's results. Outputs therefore come one step after their forward pass.
        With ``async_scheduling=False``, or while a request with penalties runs (its
        sampling reads the host's token history), step N is read before N+1 is planned.
        """
        outputs, self._aborted_outputs = self._aborted_outputs, []
        if self._awaiting_grammar:
            outputs += self._admit_compiled()
        prev = self._in_flight
        self._in_flight = None
        if prev is not None and (not self.config.async_scheduling or self._num_history_requests):
            outputs += self._read_tokens(prev)
            prev = None
        sched = self.scheduler.schedule()
        if sched.left:
            self.runner.release_rows(sched.left)
        if not sched.is_empty:
            self._in_flight = self.runner.execute(sched, prev)
            self.scheduler.update_from_output(sched)
        if prev is not None:
            outputs += self._read_tokens(prev)
        return outputs

    def _read_tokens(self, step: StepHandle) -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs."""
        sampled = step.result()
        # a loop over every sequence of the step: plain fields, no properties
        accepted = self.scheduler.append_tokens(step.seqs, sampled.token_ids)
        if not accepted:
            return []
        self.num_generated_tokens += len(accepted)
        requests = self._requests
        logprobs = sampled.logprobs if sampled.logprobs.count(None) < len(sampled.logprobs) else None
        now = time.monotonic()
        # requests with an output to give: per-step (delta) ones, and whole (final) ones a sample of which ended
        touched: dict[str, _Request] = {}
        for i, seq in accepted:
            req = requests[seq.request_id]
            if req.first_token_time is None:
                req.first_token_time = now
            token = seq.token_ids[-1]
            if logprobs is not None and logprobs[i] is not None:
                chosen, top = logprobs[i]
                req.pending_logprobs[seq.sample_index].append(top)
                req.cumulative_logprob[seq.sample_index] += chosen
            self._check_stop(seq, req.detoks[seq.sample_index], token)
            if req.params.output_kind != "final" or seq.status is SequenceStatus.FINISHED:
                touched[req.request_id] = req
        return self._outputs(touched.values())

    def _outputs(self, reqs) -> list[RequestOutput]:
        """The outputs of requests that made tokens this step (final ones only once finished)."""
        outputs = []
        for req in reqs:
            if req.params.output_kind == "final" and not req.finished:
                continue
            out = self._make_output(req)
            outputs.append(out)
            if out.finished:
                self._forget(req)
        return outputs

    def _check_stop(self, seq: Sequence, detok: IncrementalDetokenizer, token: int) -> None:
        p = seq.params
        if detok.add_token(token):  # a stop string ended the text
            self.scheduler.finish(seq, "stop", detok.stop_reason)
            return
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

    def _grammar_terminated(self, seq: Sequence, token: int) -> bool:
        """The grammar took ``token`` as its end (a stop token after a complete match): the request is done
        whatever ignore_eos says, since nothing more can follow."""
        g = self._structured.grammar(seq.seq_id, seq.request_id)
        out = seq.token_ids[seq.num_prompt_tokens:]
        if g.num_processed_tokens == len(out) - 1 and g.accept_tokens([token]):
            return g.is_terminated()
        return g.is_terminated()

    def _take_new(self, req: _Request, i: int) -> tuple[int, list[int], list[dict[int, float]] | None]:
        """Sample i's output tokens (and logprobs) not reported yet: (index of the first, ids, logprobs)."""
        seq = req.seqs[i]
        start = req.reported[i]
        new_ids = seq.token_ids[seq.num_prompt_tokens + start :]
        req.reported[i] = start + len(new_ids)
        lps, req.pending_logprobs[i] = req.pending_logprobs[i], []
        return start, new_ids, lps if seq.params.logprobs is not None else None

    @staticmethod
    def _final_metrics(req: _Request) -> dict[str, float]:
        if not req.finished or req.first_token_time is None:
            return {}
        return {"arrival_time": req.arrival_time, "time_to_first_token": req.first_token_time - req.arrival_time}

    def _make_output(self, req: _Request) -> RequestOutput:
        completions = []
        for i, (seq, detok) in enumerate(zip(req.seqs, req.detoks)):
            start, new_ids, lps = self._take_new(req, i)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=detok.take_delta(seq.is_finished),
                    token_ids=new_ids,
                    first_token_index=start,
                    cumulative_logprob=req.cumulative_logprob[i] if lps is not None else None,
                    logprobs=lps,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, req.finished,
                             error=req.error, metrics=self._final_metrics(req))

    # ---- stats ----------------------------------------------------------------------
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
