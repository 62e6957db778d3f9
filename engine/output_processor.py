"""From the engine core's token ids to ``RequestOutput``s: the one place that detokenizes, cuts a
sample at a stop string, merges logprobs, keeps a request's ``n`` samples, holds whole outputs back
for ``output_kind="final"``, measures arrival and time to first token, and writes abort and error
outputs (as vLLM v1's ``OutputProcessor``). ``LLMEngine`` (in-process, engine/llm_engine.py) and
``EngineProcess`` (the caller's side of the engine core process) both use it.

    proc = OutputProcessor(tokenizer)
    proc.add_request(rid, "job-1", prompt, prompt_token_ids, resume_token_ids, params)
    step = proc.process(core_outputs)   # RequestDelta | TokenBatch, as the core sends them
    step.outputs                        # RequestOutputs (delta per request; final ones once)
    step.stop_samples, step.aborts      # what the core must be told: samples a stop string ended here,
                                        # requests it still runs that ended here
    proc.abort(rid)                     # the request's final output, finish_reason 'abort'

The core stops at EOS, stop token ids, lengths and a grammar's end, and reports every step; stop
strings are watched here. The core never reads a request's stop strings or output_kind, so a core
in another process is sent ``core_params(params)`` (neither). Tokens the core sampled past a stop
string before it heard of it are dropped. In-process, ``LLMEngine`` tells its core of
``stop_samples`` and ``aborts`` in the same step, before the next one is planned.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from pagestream.engine.core_messages import StopSample, TokenBatch
from pagestream.engine.detokenizer import IncrementalDetokenizer
from pagestream.engine.outputs import CompletionOutput, RequestOutput
from pagestream.engine.sampling_params import SamplingParams


def core_params(params: SamplingParams) -> SamplingParams:
    """``params`` as the core runs them: stop strings are the output processor's, and the core
    reports every step (token ids are cheap), whatever this request's output_kind."""
    if not params.stop and params.output_kind == "delta":
        return params
    return dataclasses.replace(params, stop=None, output_kind="delta")


@dataclass(slots=True, eq=False)
class RequestState:
    """A request as the output processor keeps it: what the core need not send back, and the text."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detoks: list[IncrementalDetokenizer]
    reported: list[int]  # per sample: output tokens reported so far (resumed ones included; delta outputs)
    done: list[bool]  # per sample: ended (by the core, or here at a stop string)
    finish: list[tuple[str | None, int | str | None]]  # per sample: (finish_reason, stop_reason)
    cumulative: list[float | None]
    stopped_here: list[bool]  # per sample: a stop string ended it on this side
    told: list[bool]  # per sample: the core has been told of that stop
    whole: list[CompletionOutput] | None = None  # output_kind "final": token ids (and logprobs) so far
    metrics: dict | None = None  # the core's, with its last output (else ours: arrival, first token)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    prompt_logprobs: list | None = None  # the core's, until reported (delta) or with the final output
    num_cached_tokens: int = 0  # the core's (RequestOutput.num_cached_tokens), once it sends it


@dataclass(slots=True)
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    stop_samples: list[StopSample] = field(default_factory=list)  # tell the core: these samples stopped
    aborts: list[int] = field(default_factory=list)  # tell the core: these requests ended here


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[int, RequestState] = {}
        self.num_seqs = 0  # samples of the live requests

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, rid: int) -> bool:
        return rid in self._states

    def add_request(self, rid: int, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    resume_token_ids: list[int], params: SamplingParams) -> None:
        """Track a request; the text of ``resume_token_ids`` (already produced) counts as emitted."""
        n = params.n
        detoks = []
        for _ in range(n):
            detok = IncrementalDetokenizer(self.tokenizer, params)
            for t in resume_token_ids:
                detok.add_token(t)
            detok.take_delta(finished=False)
            detoks.append(detok)
        num_resumed = len(resume_token_ids)
        want_lps = params.logprobs is not None
        whole = None
        if params.output_kind == "final":  # token_ids are those made here: the first has index num_resumed
            whole = [CompletionOutput(i, "", [], num_resumed, logprobs=[] if want_lps else None) for i in range(n)]
        self._states[rid] = RequestState(
            request_id, prompt, prompt_token_ids, params, detoks, [num_resumed] * n, [False] * n,
            [(None, None)] * n, [0.0 if want_lps else None] * n, [False] * n, [False] * n, whole,
            arrival_time=time.monotonic())
        self.num_seqs += n

    def abort(self, rid: int) -> RequestOutput | None:
        """Forget a request; its final output (samples still running end with 'abort')."""
        state = self._states.get(rid)
        if state is None:
            return None
        self._forget(rid)
        for i in range(state.params.n):
            if not state.done[i]:
                state.finish[i] = ("abort", None)
        out = self._output(state, [[] for _ in state.detoks], [None] * len(state.detoks), force=True)
        out.metrics = self._metrics(state)
        return out

    @staticmethod
    def _metrics(state: RequestState) -> dict[str, float]:
        if state.metrics:
            return state.metrics
        if state.first_token_time is None:
            return {}
        return {"arrival_time": state.arrival_time, "time_to_first_token": state.first_token_time - state.arrival_time}

    def _forget(self, rid: int) -> RequestState:
        state = self._states.pop(rid)
        self.num_seqs -= state.params.n
        return state

    def process(self, core_outputs) -> ProcessedOutputs:
        """Turn the core's outputs (``RequestDelta`` / ``TokenBatch``, of one or more core steps) into
        one output per request touched."""
        states = self._states
        now = time.monotonic()
        # per request touched: per sample the new token ids and their logprobs
        new: dict[int, tuple[RequestState, list[list[int]], list[list | None]]] = {}
        errors: dict[int, str] = {}
        for out in core_outputs:
            if type(out) is TokenBatch:  # one token each for single-sample requests
                for rid, token in zip(*out):
                    state = states.get(rid)
                    if state is None or state.done[0]:
                        continue  # ended here (abort, stop string) while its tokens were on the way
                    whole = state.whole
                    if whole is not None:  # output_kind "final": gathered as they come, no per-step output
                        if state.first_token_time is None:
                            state.first_token_time = now
                        whole[0].token_ids.append(token)
                        detok = state.detoks[0]
                        if detok.add_token(token):
                            state.done[0] = state.stopped_here[0] = True
                            state.finish[0] = ("stop", detok.stop_reason)
                            new[rid] = (state, [[]], [None])  # its output, below
                        continue
                    entry = new.get(rid)
                    if entry is None:
                        new[rid] = (state, [[token]], [None])
                    else:
                        entry[1][0].append(token)
                continue
            rid, error, metrics, comps = out.rid, out.error, out.metrics, out.samples
            state = states.get(rid)
            if state is None:
                continue  # ended here (abort, stop string) while its tokens were on the way
            if metrics:
                state.metrics = metrics
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
            if out.num_cached_tokens is not None:
                state.num_cached_tokens = out.num_cached_tokens
            entry = new.get(rid)
            if entry is None:
                n = state.params.n
                entry = new[rid] = (state, [[] for _ in range(n)], [None] * n)
            for index, ids, cumulative, lps, fin, stop in comps:
                if state.done[index]:
                    continue
                if ids:
                    entry[1][index].extend(ids)
                    if lps is not None:
                        entry[2][index] = (entry[2][index] or []) + lps
                state.cumulative[index] = cumulative
                if fin is not None:
                    state.done[index] = True
                    state.finish[index] = (fin, stop)
            if error is not None:
                errors[rid] = error.message
        result = ProcessedOutputs()
        outputs = result.outputs
        for rid, (state, ids, lps) in new.items():
            if state.first_token_time is None and any(ids):
                state.first_token_time = now
            stops = self._detokenize(state, ids, lps)
            error = errors.get(rid)
            out = self._output(state, ids, lps, force=error is not None)
            if out is None:  # output_kind "final", not finished yet
                if stops:
                    self._tell_stops(state, rid, result)
                continue
            if error is not None:
                out.error = error
            if out.finished:
                out.metrics = self._metrics(state)
                self._forget(rid)
                if error is None and any(state.stopped_here):
                    result.aborts.append(rid)  # the core still runs it: free its blocks
            elif stops:
                self._tell_stops(state, rid, result)
            outputs.append(out)
        return result

    @staticmethod
    def _tell_stops(state: RequestState, rid, result: ProcessedOutputs) -> None:
        for i, stopped in enumerate(state.stopped_here):
            if stopped and not state.told[i]:
                state.told[i] = True
                result.stop_samples.append(StopSample(rid, i, state.finish[i][1]))

    @staticmethod
    def _detokenize(state: RequestState, ids: list[list[int]], lps: list[list | None]) -> bool:
        """Text for the new tokens, cutting a sample at a stop string (later tokens are dropped).
        True when a stop string ended a sample here."""
        stopped = False
        for i, new_ids in enumerate(ids):
            detok = state.detoks[i]
            for k, t in enumerate(new_ids):
                if detok.add_token(t):
                    del new_ids[k + 1:]
                    if lps[i] is not None:
                        del lps[i][k + 1:]
                    state.done[i] = state.stopped_here[i] = True
                    state.finish[i] = ("stop", detok.stop_reason)
                    stopped = True
                    break
        return stopped

    @staticmethod
    def _output(state: RequestState, ids: list[list[int]], lps: list[list | None], force: bool = False) -> RequestOutput | None:
        """This step's output: a delta, or for output_kind "final" the whole output once finished (None before)."""
        want_lps = state.params.logprobs is not None
        finished = force or all(state.done)
        whole = state.whole
        if whole is not None:  # output_kind "final": gather, and show text only at the end
            for i, w in enumerate(whole):
                new_ids = ids[i]
                if new_ids:
                    w.token_ids += new_ids
                    if want_lps and lps[i]:
                        w.logprobs += lps[i]
            if not finished:
                return None
            for i, w in enumerate(whole):
                w.text += state.detoks[i].take_delta(True)
                w.cumulative_logprob = state.cumulative[i] if want_lps else None
                w.finish_reason, w.stop_reason = state.finish[i]
            return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, whole, True,
                                 prompt_logprobs=state.prompt_logprobs, num_cached_tokens=state.num_cached_tokens)
        comps = []
        for i, detok in enumerate(state.detoks):
            fin, stop = state.finish[i]
            first = state.reported[i]
            state.reported[i] += len(ids[i])
            comps.append(CompletionOutput(
                index=i, text=detok.take_delta(state.done[i] or force), token_ids=ids[i], first_token_index=first,
                cumulative_logprob=state.cumulative[i] if want_lps else None,
                logprobs=(lps[i] or []) if want_lps else None, finish_reason=fin, stop_reason=stop,
            ))
        prompt_lps, state.prompt_logprobs = state.prompt_logprobs, None  # a delta output carries them once
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, comps, finished,
                             prompt_logprobs=prompt_lps, num_cached_tokens=state.num_cached_tokens)
