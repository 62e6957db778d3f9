"""The engine in a process of its own, driven through ``LLMEngine``'s interface.

    engine = EngineProcess(EngineConfig(model=...))      # spawns the engine core, waits for it
    engine.add_request("job-1", prompt="Hi", params=SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...                     # incremental RequestOutputs, as LLMEngine's
    engine.close()

The core's loop is engine/core_process.py. Why: a queue worker spends host time of its own on
every step (Redis reads and writes, publishing, per-job bookkeeping) and runs a publisher and a control thread. In one process
all of that shares a GIL with the engine's step, so the GPU waits whenever the worker's
Python runs. Here the core (scheduler, model runner, sampler: a plain ``LLMEngine`` that
reports token ids only) loops in its own process, stepping back to back while it has work;
the caller's side checks and tokenizes inputs, detokenizes, and watches stop strings, as
vLLM v1 splits its engine core from the front end.

Outputs are those of ``LLMEngine`` in one process: the same token ids and text, the text
cut at a stop string the same way (the caller runs the same ``IncrementalDetokenizer``);
tokens the core sampled past a stop string before it heard of it are dropped. A ``step``
merges what several core steps produced into one delta per request. Messages (engine/core_messages.py)
cross a ``multiprocessing`` pipe with a reader thread on each side, so the core never waits
for the caller to read, and a burst of requests never waits for the core's step to end.
Outputs carry only what changed (request ids are small integers; prompts stay here).

A core that dies (CUDA error, OOM-kill) makes every later call raise ``EngineDeadError``;
a caller that dies closes the pipe and the core exits.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass

from pagestream.engine.config import EngineConfig
from pagestream.engine.core_messages import (AddRequest, CoreOutput, CoreOutputType, CoreRequest, CoreRequestType,
                                              EngineCoreError, ErrorType, StopSample, TokenBatch)
from pagestream.engine.core_process import _core_main
from pagestream.engine.detokenizer import IncrementalDetokenizer
from pagestream.engine.errors import EngineDeadError
from pagestream.engine.input_processor import EngineLimits, InputProcessor
from pagestream.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from pagestream.engine.sampling_params import SamplingParams
from pagestream.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_ADD_BATCH = 32  # requests added in one go are sent to the core in batches of this many
# step() waits at most this long for the core's next output: short, so the worker's loop gets back
# to its queue (a burst of jobs still arriving) rather than sit out a long prefill step
_STEP_WAIT_S = 0.005
_START_TIMEOUT_S = 1800.0  # loading a large model and capturing graphs can take minutes


@dataclass(slots=True, eq=False)
class _Live:
    """A request as the caller's side keeps it: what the core need not send back, and the text."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detoks: list[IncrementalDetokenizer]
    reported: list[int]  # per sample: output tokens reported so far (resumed ones included)
    done: list[bool]  # per sample: ended (by the core, or here at a stop string)
    finish: list[tuple[str | None, int | str | None]]  # per sample: (finish_reason, stop_reason)
    cumulative: list[float | None]
    stopped_here: list[bool]  # per sample: a stop string ended it on this side
    told: list[bool]  # per sample: the core has been told of that stop
    whole: list[CompletionOutput] | None = None  # output_kind "final": the outputs so far
    metrics: dict | None = None  # the core's, with its last output


class EngineProcess:
    """``LLMEngine``'s interface (add_request, abort_request, step, has_unfinished_requests,
    num_admittable, stats) over an engine core in a spawned process."""

    def __init__(self, config: EngineConfig, start_timeout_s: float = _START_TIMEOUT_S) -> None:
        ctx = mp.get_context("spawn")  # CUDA does not survive fork
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_core_main, args=(child, config, logging.getLogger("pagestream").getEffectiveLevel()),
                                 name="pagestream-engine-core", daemon=False)  # the core may spawn ranks of its own
        self._proc.start()
        child.close()
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        # the caller's side of PAGESTREAM_CORE_TRACE (_serve): per step() call, when the core's outputs
        # were taken, when they were turned into outputs, and how many of the core's messages they held
        self._trace_path = os.environ.get("PAGESTREAM_CORE_TRACE")
        self._trace: list[tuple[float, float, int]] = []
        if not self._conn.poll(start_timeout_s):
            self._kill()
            raise EngineDeadError(f"the engine core did not start within {start_timeout_s:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineDeadError(f"the engine core exited while starting (exit code {self._proc.exitcode})") from None
        if msg.type is CoreOutputType.FAILED:
            self._proc.join(30)
            logger.debug("engine core start-up failed:\n%s", msg.error.traceback)
            # what was wrong with the configuration, as LLMEngine(config) would have raised it
            raise msg.error.exception()
        self.limits: EngineLimits = msg.limits
        self.config: EngineConfig = msg.config
        self.inputs = InputProcessor(self.tokenizer, self.limits, self.config.model)
        logger.info("engine core ready (pid %d): %d KV blocks, max_num_seqs %d", self._proc.pid, self.limits.num_blocks,
                    self.limits.max_num_seqs)
        self._ids = itertools.count()
        self._handles: dict[str, int] = {}  # request id -> the core's id for it
        self._live: dict[int, _Live] = {}
        self._num_live_seqs = 0
        self._to_add: list[AddRequest] = []
        self._local: list[RequestOutput] = []  # abort outputs, reported at the next step as LLMEngine does
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stats: EngineStats | None = None
        self._dead: str | None = None
        self._closing = False
        threading.Thread(target=self._read_outputs, name="engine-core-outputs", daemon=True).start()

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def core_pid(self) -> int | None:
        return self._proc.pid

    # ---- input ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, resume_token_ids: list[int] | None = None,
                    priority: int = 0) -> None:
        """As ``LLMEngine.add_request``: checked and tokenized here (ValueError at once); sent with the next step."""
        self._check_alive()
        if request_id in self._handles:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        ids, resume, params = self.inputs.process(prompt, params, prompt_token_ids, resume_token_ids)
        detoks = []
        for _ in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, params)
            for t in resume:
                detok.add_token(t)
            detok.take_delta(finished=False)  # text of resumed tokens counts as emitted
            detoks.append(detok)
        rid = next(self._ids)
        n = params.n
        self._handles[request_id] = rid
        self._live[rid] = _Live(request_id, prompt, ids, params, detoks, [len(resume)] * n, [False] * n, [(None, None)] * n,
                                [None] * n, [False] * n, [False] * n,
                                [CompletionOutput(i, "", []) for i in range(n)] if params.output_kind == "final" else None)
        self._num_live_seqs += n
        # The core stops at EOS, stop token ids and lengths; stop strings are watched here. It
        # reports every step (token ids are cheap), whatever this request's output_kind.
        core_params = params if not params.stop and params.output_kind == "delta" else \
            dataclasses.replace(params, stop=None, output_kind="delta")
        self._to_add.append(AddRequest(rid, prompt, ids, resume, core_params, priority))
        if len(self._to_add) >= _ADD_BATCH:  # a burst: let the core start on it while the rest is checked
            batch, self._to_add = self._to_add, []
            self._send(CoreRequest(CoreRequestType.ADD, batch))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.inputs.chat_token_ids(messages)

    def add_chat_request(self, request_id: str, messages: list[dict], params: SamplingParams | None = None, **kwargs) -> None:
        self.add_request(request_id, prompt_token_ids=self.apply_chat_template(messages), params=params, **kwargs)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; its final output (finish_reason 'abort') comes with the next step."""
        rid = self._handles.get(request_id)
        if rid is None:
            return False
        live = self._forget(rid)
        queued = [a for a in self._to_add if a.rid == rid]
        if queued:  # never sent: nothing to stop in the core
            self._to_add.remove(queued[0])
        elif self._dead is None:
            self._send(CoreRequest(CoreRequestType.ABORT, [rid]))
        for i in range(live.params.n):
            if not live.done[i]:
                live.finish[i] = ("abort", None)
        self._local.append(self._output(live, [[] for _ in live.detoks], [None] * len(live.detoks), force=True))
        return True

    def _forget(self, rid: int) -> _Live:
        live = self._live.pop(rid)
        del self._handles[live.request_id]
        self._num_live_seqs -= live.params.n
        return live

    # ---- the step ---------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._live) or bool(self._local)

    def num_admittable(self) -> int:
        """As ``LLMEngine.num_admittable``: 0 while the core reports requests held back by the KV pool."""
        if self._stats is not None and self._stats.num_waiting and self._stats.kv_bound:
            return 0
        return max(0, self.limits.max_num_seqs - self._num_live_seqs)

    def step(self, timeout_s: float = _STEP_WAIT_S) -> list[RequestOutput]:
        """Send what was added, then return what the core produced since the last call, one
        delta per request (waiting up to ``timeout_s`` for the first of it)."""
        self._check_alive()
        if self._to_add:
            batch, self._to_add = self._to_add, []
            self._send(CoreRequest(CoreRequestType.ADD, batch))
        outputs, self._local = self._local, []
        msgs = []
        try:
            msgs.append(self._outbox.get(timeout=timeout_s) if self._live and not outputs else self._outbox.get_nowait())
            while True:
                msgs.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        t_taken = time.monotonic()
        # per request touched: per sample the new token ids and their logprobs
        new: dict[int, tuple[_Live, list[list[int]], list[list | None]]] = {}
        errors: dict[int, str] = {}
        for msg in msgs:
            if msg.type is CoreOutputType.DEAD:
                self._dead = msg.error.message
                raise msg.error.exception()
            if msg.type is CoreOutputType.STEP_ERROR:
                raise msg.error.exception()
            if msg.stats is not None:
                self._stats = msg.stats
            for out in msg.outputs:
                if type(out) is TokenBatch:  # one token each for single-sample requests
                    for rid, token in zip(*out):
                        live = self._live.get(rid)
                        if live is None or live.done[0]:
                            continue  # ended here (abort, stop string) while its tokens were on the way
                        entry = new.get(rid)
                        if entry is None:
                            new[rid] = (live, [[token]], [None])
                        else:
                            entry[1][0].append(token)
                    continue
                rid, _finished, error, metrics, comps = out
                live = self._live.get(rid)
                if live is None:
                    continue  # ended here (abort, stop string) while its tokens were on the way
                if metrics:
                    live.metrics = metrics
                entry = new.get(rid)
                if entry is None:
                    n = live.params.n
                    entry = new[rid] = (live, [[] for _ in range(n)], [None] * n)
                for index, ids, cumulative, lps, fin, stop in comps:
                    if live.done[index]:
                        continue
                    if ids:
                        entry[1][index].extend(ids)
                        if lps is not None:
                            entry[2][index] = (entry[2][index] or []) + lps
                    live.cumulative[index] = cumulative
                    if fin is not None:
                        live.done[index] = True
                        live.finish[index] = (fin, stop)
                if error is not None:
                    errors[rid] = error.message
        stop_samples, aborts = [], []
        for rid, (live, ids, lps) in new.items():
            self._detokenize(live, ids, lps)
            out = self._output(live, ids, lps)
            if rid in errors:
                out.error, out.finished = errors[rid], True
            if out.finished:
                out.metrics = live.metrics or {}
                self._forget(rid)
                if any(live.stopped_here) and rid not in errors:
                    aborts.append(rid)  # the core still runs it: free its blocks
            else:
                for i, stopped in enumerate(live.stopped_here):
                    if stopped and not live.told[i]:
                        live.told[i] = True
                        stop_samples.append(StopSample(rid, i, live.finish[i][1]))
            if live.params.output_kind == "delta" or out.finished:
                outputs.append(out)
        if self._trace_path and msgs:
            self._trace.append((t_taken, time.monotonic(), len(msgs)))
        if aborts and self._dead is None:
            self._send(CoreRequest(CoreRequestType.ABORT, aborts))
        if stop_samples and self._dead is None:
            self._send(CoreRequest(CoreRequestType.STOP_SAMPLES, stop_samples))
        return outputs

    def _detokenize(self, live: _Live, ids: list[list[int]], lps: list[list | None]) -> None:
        """Text for the new tokens, cutting a sample at a stop string (later tokens are dropped)."""
        for i, new_ids in enumerate(ids):
            detok = live.detoks[i]
            for k, t in enumerate(new_ids):
                if detok.add_token(t):
                    del new_ids[k + 1:]
                    if lps[i] is not None:
                        del lps[i][k + 1:]
                    live.done[i] = live.stopped_here[i] = True
                    live.finish[i] = ("stop", detok.stop_reason)
                    break

    def _output(self, live: _Live, ids: list[list[int]], lps: list[list | None], force: bool = False) -> RequestOutput:
        comps = []
        for i, detok in enumerate(live.detoks):
            fin, stop = live.finish[i]
            first = live.reported[i]
            live.reported[i] += len(ids[i])
            want_lps = live.params.logprobs is not None
            comps.append(CompletionOutput(
                index=i, text=detok.take_delta(live.done[i] or force), token_ids=ids[i], first_token_index=first,
                cumulative_logprob=live.cumulative[i] if want_lps else None,
                logprobs=(lps[i] or []) if want_lps else None, finish_reason=fin, stop_reason=stop,
            ))
        finished = force or all(live.done)
        if live.whole is not None:  # output_kind "final": whole outputs, once
            for w, c in zip(live.whole, comps):
                w.text += c.text
                w.token_ids += c.token_ids
                if c.logprobs is not None:
                    w.logprobs = (w.logprobs or []) + c.logprobs
                w.cumulative_logprob, w.finish_reason, w.stop_reason = c.cumulative_logprob, c.finish_reason, c.stop_reason
            comps = live.whole
        return RequestOutput(live.request_id, live.prompt, live.prompt_token_ids, comps, finished)

    def stats(self) -> EngineStats:
        self._check_alive()
        if self._stats is None:
            lim = self.limits
            return EngineStats(0, 0, lim.num_blocks, lim.num_blocks, 0.0, 0.0, 0, 0, 0, 0)
        return self._stats

    # ---- plumbing ------------------------------------------------------------------------
    def _read_outputs(self) -> None:
        try:
            while True:
                self._outbox.put(self._conn.recv())
        except (EOFError, OSError):
            pass
        self._proc.join(5)
        code = self._proc.exitcode
        if code != 0 or not self._closing:
            error = EngineCoreError(ErrorType.DEAD, f"the engine core process exited (exit code {code})")
            self._outbox.put(CoreOutput(CoreOutputType.DEAD, error=error))

    def _send(self, msg: CoreRequest) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as exc:
            self._dead = f"the engine core process is gone ({type(exc).__name__})"
            raise EngineDeadError(self._dead) from None

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the core (its requests are dropped) and wait for it to exit."""
        self._closing = True
        if self._proc.is_alive() and self._dead is None:
            try:
                self._conn.send(CoreRequest(CoreRequestType.SHUTDOWN))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout_s)
        self._kill()
        self._conn.close()
        if self._trace_path:
            with open(self._trace_path + ".caller", "w") as f:
                json.dump(self._trace, f)

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
