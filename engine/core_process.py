"""The engine core's process: the loop ``EngineProcess`` (engine/engine_process.py) spawns.

It builds an ``EngineCore`` (engine/llm_engine.py: token ids only, as core messages), then steps
it back to back while it has work and applies what the caller sends (engine/core_messages.py)
between steps; a caller that goes away closes the pipe and the loop ends.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time
import traceback

from pagestream.engine.config import EngineConfig
from pagestream.engine.core_messages import (CoreOutput, CoreOutputType, CoreRequest, CoreRequestType, EngineCoreError,
                                              ErrorType, RequestDelta)
from pagestream.engine.errors import EngineDeadError

logger = logging.getLogger(__name__)

_STATS_EVERY_S = 0.05  # the core sends EngineStats at most this often while it steps


def _core_main(conn, config: EngineConfig, log_level: int) -> None:
    """The engine core: build the engine, then step while there is work and apply what arrives."""
    # The caller owns the core's life: Ctrl-C in a terminal (SIGINT to the whole process group)
    # or a SIGTERM must reach the worker's warm stop, not kill its engine mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine-core]: %(message)s")
    try:
        from pagestream.engine.llm_engine import EngineCore  # torch lives below this line

        engine = EngineCore(config)  # token ids only: text, stop strings and outputs are the caller's
    except BaseException as exc:  # the caller raises it: a bad model, OOM, no GPU
        kind = ErrorType.INVALID_CONFIG if isinstance(exc, ValueError) else ErrorType.STARTUP
        conn.send(CoreOutput(CoreOutputType.FAILED, error=EngineCoreError.of(exc, kind, traceback.format_exc())))
        return
    conn.send(CoreOutput(CoreOutputType.READY, limits=engine.limits, config=engine.config))
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read_inputs() -> None:  # unpickling a burst of requests happens beside the step
        try:
            while True:
                inbox.put(conn.recv())
        except (EOFError, OSError):
            inbox.put(CoreRequest(CoreRequestType.SHUTDOWN))  # the caller is gone (or closed): stop

    threading.Thread(target=read_inputs, name="engine-core-inputs", daemon=True).start()
    try:
        _serve(engine, conn, inbox)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the caller is gone: nobody to report to
    finally:
        engine.runner.shutdown()  # tensor-parallel ranks leave with the core


def _serve(engine, conn, inbox: queue.SimpleQueue) -> None:
    # PAGESTREAM_CORE_TRACE=path: a diagnostic for benchmarks, the end time and the sequences of every
    # step, written as JSON when the core stops
    trace_path = os.environ.get("PAGESTREAM_CORE_TRACE")
    trace: list[tuple[float, int]] = []
    try:
        _serve_loop(engine, conn, inbox, trace if trace_path else None)
    finally:
        if trace_path:
            with open(trace_path, "w") as f:
                json.dump(trace, f)


def _serve_loop(engine, conn, inbox: queue.SimpleQueue, trace: list | None) -> None:
    last_stats = 0.0
    while True:
        msgs = [inbox.get()] if not engine.has_unfinished_requests() else []
        while True:
            try:
                msgs.append(inbox.get_nowait())
            except queue.Empty:
                break
        for msg in msgs:
            kind = msg.type
            if kind is CoreRequestType.ADD:
                for rid, _prompt, ids, resume, params, priority in msg.payload:
                    try:
                        engine.add_request(rid, ids, resume, params, priority)
                    except Exception as exc:  # checked on the caller's side; an engine bug fails this request only
                        error = EngineCoreError.of(exc, ErrorType.REQUEST)
                        conn.send(CoreOutput(CoreOutputType.OUTPUTS, [RequestDelta(rid, True, error, None, [])]))
            elif kind is CoreRequestType.ABORT:
                for rid in msg.payload:
                    engine.abort_request(rid)
            elif kind is CoreRequestType.STOP_SAMPLES:
                for rid, index, reason in msg.payload:
                    engine.finish_sample(rid, index, reason)
            elif kind is CoreRequestType.SHUTDOWN:
                return
        if not engine.has_unfinished_requests():
            conn.send(CoreOutput(CoreOutputType.OUTPUTS, [], engine.stats(), engine.take_iteration_tokens()))
            continue
        try:
            outs = engine.step()
        except EngineDeadError as exc:  # a tensor-parallel rank died: this engine is over
            conn.send(CoreOutput(CoreOutputType.DEAD, error=EngineCoreError(ErrorType.DEAD, f"engine core: {exc}")))
            return
        except Exception:  # the caller treats it as LLMEngine.step raising; the core goes on
            tb = traceback.format_exc()
            conn.send(CoreOutput(CoreOutputType.STEP_ERROR, error=EngineCoreError(ErrorType.STEP, tb.strip().splitlines()[-1], tb)))
            continue
        now = time.monotonic()
        if trace is not None:
            trace.append((now, len(engine.scheduler.running)))
        stats = None
        if now - last_stats >= _STATS_EVERY_S or not engine.has_unfinished_requests():
            stats, last_stats = engine.stats(), now
        if outs or stats is not None:  # a step's token count rides with the next message sent
            conn.send(CoreOutput(CoreOutputType.OUTPUTS, outs, stats, engine.take_iteration_tokens()))
