"""Tensor parallelism over processes: rank 0's driver of the other ranks (groups and collectives:
``engine.parallel_state``).

Rank 0 is the engine's own process: it schedules, prepares each step's inputs, samples. Ranks
1..N-1 are spawned processes (``_rank_main``) that hold their shard of the weights and of the
KV pool and replay every step rank 0 launches:

    rank 0: prepare(step) -> header over a pipe -> broadcast of the input buffers -> forward -> sample
    rank r: header from the pipe -> receive the input buffers -> the same forward (all-reduces meet)

The header is small (shapes, offsets); the buffers go over the collective, device to device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import time
import traceback
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist

from pagestream.engine.errors import EngineDeadError
from pagestream.engine.parallel_state import disable_multicast, free_port, init_group

if TYPE_CHECKING:
    from pagestream.engine.config import EngineConfig
    from pagestream.engine.model_runner import StepInputs

logger = logging.getLogger(__name__)


# ---- one step's inputs, shipped from rank 0 ----------------------------------------------------
def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def pack_step(inp: "StepInputs") -> tuple[dict, list[torch.Tensor]]:
    """A header (plain Python) and the buffers to broadcast, from a prepared step.

    The step's tensors are views into a few packed buffers (``ModelRunner.prepare``); each
    buffer's whole storage travels as bytes and the header says where each view sits in it,
    so this keeps working whatever layout ``prepare`` chooses.
    """
    buffers: list[torch.Tensor] = []
    where: dict[int, int] = {}

    def spec(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in where:
            where[key] = len(buffers)
            buffers.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
        return ("tensor", where[key], str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset())

    meta = {f.name: getattr(inp.meta, f.name) for f in dataclasses.fields(inp.meta)}
    header = {
        "input_ids": spec(inp.input_ids),
        "positions": spec(inp.positions),
        "sample_rows": spec(inp.sample_rows),
        "meta": {k: spec(v) if isinstance(v, torch.Tensor) else ("value", v) for k, v in meta.items()},
        "buffer_bytes": [b.numel() for b in buffers],
    }
    return header, buffers


def unpack_step(header: dict, buffers: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor]:
    """``pack_step``'s tensors rebuilt over the received buffers: (input_ids, positions, the
    attention metadata's fields, sample_rows); the runner makes its ``StepInputs`` of them."""

    def build(s):
        if s[0] == "value":
            return s[1]
        _, i, dtype, shape, stride, offset = s
        return buffers[i].view(_dtype(dtype)).as_strided(shape, stride, offset)

    meta = {k: build(v) for k, v in header["meta"].items()}
    return build(header["input_ids"]), build(header["positions"]), meta, build(header["sample_rows"])


# ---- rank 0's side ---------------------------------------------------------------------------------
class TensorParallelDriver:
    """Rank 0's handle on the other ranks: starts them, ships each step, notices a death.

    ``build_runner(config, tp)`` (a module-level function: it crosses to the spawned ranks) makes a
    rank's runner, which has ``warm_up()`` and ``follow(header)``."""

    def __init__(self, config: "EngineConfig", device: torch.device, build_runner: Callable) -> None:
        self.size = config.tensor_parallel_size
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        disable_multicast()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")  # CUDA does not survive fork
        self.procs: list[mp.process.BaseProcess] = []
        self.conns = []
        self._closed = False
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, config, init_method, self.backend, theirs, build_runner),
                               name=f"pagestream-tp{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        for rank in range(1, self.size):  # each rank says hello once torch is imported and its device set
            self._expect(rank, "hello", timeout_s=300)
        self.tp = init_group(self.backend, init_method, 0, self.size, device)

    def _expect(self, rank: int, what: str, timeout_s: float) -> None:
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        end = time.monotonic() + timeout_s
        while not conn.poll(0.1):
            if not proc.is_alive() or time.monotonic() > end:
                self.shutdown()
                raise EngineDeadError(f"tensor-parallel rank {rank} did not start: {self._death(rank)}")
        msg = conn.recv()
        if msg[0] != what:
            self.shutdown()
            raise EngineDeadError(f"tensor-parallel rank {rank} failed to start:\n{msg[1]}")

    def _death(self, rank: int) -> str:
        """What is known about a rank that stopped: its exit code and the error it sent, if any."""
        proc, conn = self.procs[rank - 1], self.conns[rank - 1]
        proc.join(timeout=5)
        said = ""
        with contextlib.suppress(Exception):
            while conn.poll(0):
                msg = conn.recv()
                if isinstance(msg, tuple) and msg and msg[0] == "error":
                    said = f"; it reported:\n{msg[1]}"
        code = proc.exitcode
        state = "is still running but does not answer" if code is None else f"exited with code {code}"
        return f"process {proc.pid} {state}{said}"

    def check(self) -> None:
        """Raise EngineDeadError if any rank has exited."""
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise EngineDeadError(f"tensor-parallel rank {rank} of {self.size} died ({self._death(rank)}); "
                                      "the engine cannot continue without its shard of the weights and KV cache")

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """A collective failing because a peer went away (gloo raises at once) becomes EngineDeadError;
        any other error (out of memory, a bad input) stays what it is."""
        try:
            yield
        except EngineDeadError:
            raise
        except RuntimeError as exc:
            # A peer's death reaches this rank as a collective's error, maybe before its exit code
            # does: give it a moment to show (an error path, so the wait costs nothing in a step).
            deadline = time.monotonic() + (5 if isinstance(exc, dist.DistError) else 2)
            while time.monotonic() < deadline and all(p.is_alive() for p in self.procs):
                time.sleep(0.05)
            self.check()
            raise

    def publish(self, inp: "StepInputs") -> None:
        """Send the step to every other rank: its header down the pipes, its buffers by broadcast."""
        self.check()
        header, buffers = pack_step(inp)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(("step", header))
            except (BrokenPipeError, ConnectionError, EOFError):
                self.check()
                raise EngineDeadError(f"tensor-parallel rank {rank} stopped reading its steps") from None
        with self.guard():
            for buf in buffers:
                dist.broadcast(buf, src=0, group=self.tp.group)

    def watch(self, event):
        """Wrap a CUDA event so waiting on it notices a dead rank instead of hanging forever
        (a peer gone mid all-reduce leaves this rank's NCCL kernel spinning)."""
        return _WatchedEvent(event, self) if event is not None else None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            # Tearing a communicator down can block (NCCL waits on peers that are already gone):
            # give it a while in a thread, so that shutting an engine down never hangs its process.
            import threading

            done = threading.Event()

            def destroy():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
                done.set()

            threading.Thread(target=destroy, name="pagestream-tp-destroy", daemon=True).start()
            if not done.wait(15):
                logger.warning("tensor-parallel process group did not tear down within 15 s; left behind")


class _WatchedEvent:
    def __init__(self, event, driver: TensorParallelDriver) -> None:
        self.event, self.driver = event, driver

    def synchronize(self) -> None:
        next_check = time.monotonic() + 0.01
        while not self.event.query():
            if time.monotonic() >= next_check:
                self.driver.check()
                next_check = time.monotonic() + 0.01
            time.sleep(0)  # give the GIL to the worker's threads while the device runs


# ---- ranks 1..N-1 ----------------------------------------------------------------------------------
def _rank_main(rank: int, config: "EngineConfig", init_method: str, backend: str, conn, build_runner: Callable) -> None:
    """A spawned rank: build its shard, then replay rank 0's steps until told to stop (or until
    rank 0 goes away: the pipe closes)."""
    disable_multicast()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        conn.send(("hello", os.getpid()))
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        tp = init_group(backend, init_method, rank, config.tensor_parallel_size, device)
        runner = build_runner(config, tp)
        runner.warm_up()  # rank 0's engine warms up right after building its runner: the same collectives
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if msg is None:
                break
            runner.follow(msg[1])
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        os._exit(1)
    # Leave without tearing down the communicator or the CUDA graphs that captured it (that can
    # block on the other ranks); the process's exit releases this rank's memory and links.
    os._exit(0)
