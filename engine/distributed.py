"""Tensor parallelism over processes: one process per rank, torch.distributed between them
(NCCL on CUDA, gloo on the CPU).

Rank 0 is the engine's own process: it schedules, prepares each step's inputs, samples. Ranks
1..N-1 are spawned processes (``_follower_main``) that hold their shard of the weights and of the
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
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from pagestream.engine.errors import EngineDeadError

if TYPE_CHECKING:
    from pagestream.engine.config import EngineConfig
    from pagestream.engine.model_runner import StepInputs

logger = logging.getLogger(__name__)

# NVLink multicast (NVLS) can take a host's shared GPUs out of service: keep it off in this
# process and, through the inherited environment, in every rank it spawns (set again there).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_multicast() -> None:
    os.environ.update(MULTICAST_OFF)


def _timeout() -> timedelta:
    # How long a collective may wait for a peer: longer than the slowest rank's weight load.
    return timedelta(seconds=float(os.environ.get("PAGESTREAM_TP_TIMEOUT_S", "600")))


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group. ``group`` is None at size 1, and also
    when a model is only being sized (built on the meta device): then nothing communicates."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1 and self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[n, d] on each rank -> [n, size * d], rank 0's columns first (every rank gets it)."""
        if self.size == 1 or self.group is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


_current = TPGroup()


def current_tp() -> TPGroup:
    """The group layers built now belong to (``tensor_parallel`` sets it around model construction)."""
    return _current


@contextlib.contextmanager
def tensor_parallel(tp: TPGroup) -> Iterator[TPGroup]:
    """Build layers for ``tp``: each parallel layer keeps the group it was built under."""
    global _current
    prev, _current = _current, tp
    try:
        yield tp
    finally:
        _current = prev


def init_group(backend: str, init_method: str, rank: int, size: int, device: torch.device) -> TPGroup:
    disable_multicast()
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device  # create the communicator now: a broken link fails at start, not mid-step
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=_timeout(), **kwargs)
    return TPGroup(rank, size, dist.group.WORLD)


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


def unpack_step(header: dict, buffers: list[torch.Tensor]) -> "StepInputs":
    from pagestream.engine.layers.attention import AttentionMetadata
    from pagestream.engine.model_runner import StepInputs

    def build(s):
        if s[0] == "value":
            return s[1]
        _, i, dtype, shape, stride, offset = s
        return buffers[i].view(_dtype(dtype)).as_strided(shape, stride, offset)

    meta = AttentionMetadata(**{k: build(v) for k, v in header["meta"].items()})
    return StepInputs(build(header["input_ids"]), build(header["positions"]), meta, build(header["sample_rows"]), [])


# ---- rank 0's side ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelDriver:
    """Rank 0's handle on the other ranks: starts them, ships each step, notices a death."""

    def __init__(self, config: "EngineConfig", device: torch.device) -> None:
        self.size = config.tensor_parallel_size
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        disable_multicast()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")  # CUDA does not survive fork
        self.procs: list[mp.process.BaseProcess] = []
        self.conns = []
        self._closed = False
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_follower_main, args=(rank, config, init_method, self.backend, theirs),
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
def _follower_main(rank: int, config: "EngineConfig", init_method: str, backend: str, conn) -> None:
    """A spawned rank: build its shard, then replay rank 0's steps until told to stop (or until
    rank 0 goes away: the pipe closes)."""
    disable_multicast()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        conn.send(("hello", os.getpid()))
        from pagestream.engine.model_runner import ModelRunner

        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        tp = init_group(backend, init_method, rank, config.tensor_parallel_size, device)
        runner = ModelRunner(config, set(), tp=tp)
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
