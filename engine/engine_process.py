"""The engine in a process of its own, driven through ``LLMEngine``'s interface.

    engine = EngineProcess(EngineConfig(model=...))      # spawns the engine core, waits for it
    engine.add_request("job-1", prompt="Hi", params=SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...                     # incremental RequestOutputs, as LLMEngine's
    engine.close()

The core's loop is engine/core_process.py. Why: a queue worker spends host time of its own on
every step (Redis reads and writes, publishing, per-job bookkeeping) and runs a publisher and a control thread. In one process
all of that shares a GIL with the engine's step, so the GPU waits whenever the worker's
Python runs. Here the core (``EngineCore``, engine/llm_engine.py: scheduler, model runner,
sampler, grammars, reporting token ids only) loops in its own process, stepping back to back
while it has work; the caller's side checks and tokenizes inputs and runs the same
``OutputProcessor`` as ``LLMEngine`` (detokenization, stop strings, final vs delta, logprobs,
abort outputs), as vLLM v1 splits its engine core from the front end.

Outputs are those of ``LLMEngine`` in one process: the same token ids and text, the text
cut at a stop string the same way (the same ``OutputProcessor``); tokens the core sampled
past a stop string before it heard of it are dropped. A ``step``
merges what several core steps produced into one delta per request. Messages (engine/core_messages.py)
cross a ``multiprocessing`` pipe with a reader thread on each side, so the core never waits
for the caller to read, and a burst of requests never waits for the core's step to end.
Outputs carry only what changed (request ids are small integers; prompts stay here).

A core that dies (CUDA error, OOM-kill) makes every later call raise ``EngineDeadError``;
a caller that dies closes the pipe and the core exits.
"""
from __future__ import annotations

import collections
import itertools
import json
import logging
import multiprocessing as mp
import os
import queue
import threading
import time

from pagestream.engine.config import EngineConfig
from pagestream.engine.core_messages import (AddRequest, CoreOutput, CoreOutputType, CoreRequest, CoreRequestType,
                                              EngineCoreError, ErrorType)
from pagestream.engine.core_process import _core_main
from pagestream.engine.errors import EngineDeadError
from pagestream.engine.input_processor import ChatRequests, EngineLimits, InputProcessor
from pagestream.engine.output_processor import OutputProcessor, core_params
from pagestream.engine.outputs import ITERATION_TOKENS_KEPT, EngineStats, RequestOutput
from pagestream.engine.sampling_params import SamplingParams
from pagestream.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_ADD_BATCH = 32  # requests added in one go are sent to the core in batches of this many
# step() waits at most this long for the core's next output: short, so the worker's loop gets back
# to its queue (a burst of jobs still arriving) rather than sit out a long prefill step
_STEP_WAIT_S = 0.005
_START_TIMEOUT_S = 1800.0  # loading a large model and capturing graphs can take minutes


class EngineProcess(ChatRequests):
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
        self.output_processor = OutputProcessor(self.tokenizer)
        self._to_add: list[AddRequest] = []
        self._local: list[RequestOutput] = []  # abort outputs, reported at the next step as LLMEngine does
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stats: EngineStats | None = None
        # the core's steps' token counts, until take_iteration_tokens()
        self._iteration_tokens: collections.deque[int] = collections.deque(maxlen=ITERATION_TOKENS_KEPT)
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
                    priority: int = 0, truncate_prompt_tokens: int | None = None,
                    truncation_side: str | None = None) -> None:
        """As ``LLMEngine.add_request``: checked, tokenized and truncated here (ValueError at once); sent with the next step."""
        self._check_alive()
        if request_id in self._handles:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        ids, resume, params = self.inputs.process(prompt, params, prompt_token_ids, resume_token_ids,
                                                  truncate_prompt_tokens, truncation_side)
        rid = next(self._ids)
        self._handles[request_id] = rid
        self.output_processor.add_request(rid, request_id, prompt, ids, resume, params)
        self._to_add.append(AddRequest(rid, prompt, ids, resume, core_params(params), priority))
        if len(self._to_add) >= _ADD_BATCH:  # a burst: let the core start on it while the rest is checked
            batch, self._to_add = self._to_add, []
            self._send(CoreRequest(CoreRequestType.ADD, batch))

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; its final output (finish_reason 'abort') comes with the next step."""
        rid = self._handles.get(request_id)
        if rid is None:
            return False
        del self._handles[request_id]
        queued = [a for a in self._to_add if a.rid == rid]
        if queued:  # never sent: nothing to stop in the core
            self._to_add.remove(queued[0])
        elif self._dead is None:
            self._send(CoreRequest(CoreRequestType.ABORT, [rid]))
        self._local.append(self.output_processor.abort(rid))
        return True

    # ---- the step ---------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor) or bool(self._local)

    def num_admittable(self) -> int:
        """As ``LLMEngine.num_admittable``: 0 while the core reports requests held back by the KV pool."""
        if self._stats is not None and self._stats.num_waiting and self._stats.kv_bound:
            return 0
        return max(0, self.limits.max_num_seqs - self.output_processor.num_seqs)

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
            msgs.append(self._outbox.get(timeout=timeout_s) if self.output_processor and not outputs else self._outbox.get_nowait())
            while True:
                msgs.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        t_taken = time.monotonic()
        core_outputs = []
        for msg in msgs:
            if msg.type is CoreOutputType.DEAD:
                self._dead = msg.error.message
                raise msg.error.exception()
            if msg.type is CoreOutputType.STEP_ERROR:
                raise msg.error.exception()
            if msg.stats is not None:
                self._stats = msg.stats
            self._iteration_tokens.extend(msg.iteration_tokens)
            core_outputs += msg.outputs
        done = self.output_processor.process(core_outputs)
        for out in done.outputs:
            if out.finished:
                del self._handles[out.request_id]
        outputs += done.outputs
        if self._trace_path and msgs:
            self._trace.append((t_taken, time.monotonic(), len(msgs)))
        if done.aborts and self._dead is None:
            self._send(CoreRequest(CoreRequestType.ABORT, done.aborts))
        if done.stop_samples and self._dead is None:
            self._send(CoreRequest(CoreRequestType.STOP_SAMPLES, done.stop_samples))
        return outputs

    def stats(self) -> EngineStats:
        self._check_alive()
        if self._stats is None:
            lim = self.limits
            return EngineStats(0, 0, lim.num_blocks, lim.num_blocks, 0.0, 0.0, 0, 0, 0, 0)
        return self._stats

    def take_iteration_tokens(self) -> list[int]:
        """As ``LLMEngine.take_iteration_tokens``: the core's steps whose messages ``step`` took since the last call."""
        taken = list(self._iteration_tokens)
        self._iteration_tokens.clear()
        return taken

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
