"""Helpers for the queue tests: worker processes, waiting on Redis state, raw out-stream reads."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.lanes import resolve_layout
from pagestream.producer.protocol.wire import decode_out_entry
from zygote import spawn

ROOT = Path(__file__).resolve().parents[1]


class WorkerProc:
    """``python -m worker.cli worker`` as a separate process, its output in a log file."""

    def __init__(self, redis_url: str, model: str, consumer: str, *args: str, log_dir: Path, env: dict | None = None) -> None:
        self.consumer = consumer
        self.metrics_port = int(args[args.index("--metrics-port") + 1]) if "--metrics-port" in args else None
        self.log_path = log_dir / f"{consumer}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "pagestream.worker.cli", "worker", "--redis-url", redis_url, "--model", model,
               "--consumer", consumer, "--device", "cpu", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = spawn(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 120.0) -> None:
        wait_for(lambda: "ready" in self.log() or self.proc.poll() is not None, timeout, f"worker {self.consumer} ready")
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.consumer} exited:\n{self.log()}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def engine_core_pid(w: WorkerProc) -> int:
    """The pid of a worker's engine core process (``--engine-process``), from its log."""
    m = re.search(r"engine core ready \(pid (\d+)\)", w.log())
    assert m, f"worker {w.consumer} logged no engine core:\n{w.log()}"
    return int(m.group(1))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited; only its parent's wait is missing
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def wait_for(cond: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def raw_events(r: redis.Redis, job_id: str) -> list:
    """Every event in a job's out stream, in order, without deduplication."""
    return [decode_out_entry(job_id, f) for _, f in r.xrange(keys.out_stream(job_id))]


def assert_contiguous(r: redis.Redis, job_id: str) -> str:
    """The raw stream holds each token index exactly once, in order, then one end entry. Returns the text."""
    evs = raw_events(r, job_id)
    assert evs and isinstance(evs[-1], str), f"{job_id}: stream does not end with an end entry: {evs[-3:]}"
    next_index: dict[int, int] = {}
    text: dict[int, str] = {}
    for ev in evs[:-1]:
        assert not isinstance(ev, str), f"{job_id}: more than one end entry"
        assert ev.index == next_index.get(ev.sample, 0), f"{job_id}: event at index {ev.index}, expected {next_index.get(ev.sample, 0)}"
        next_index[ev.sample] = ev.end_index
        text[ev.sample] = text.get(ev.sample, "") + ev.text
    return text.get(0, "")


def lane_streams(r: redis.Redis, lane: str) -> list[str]:
    """The streams of a lane: one on a single node, every shard on a cluster (``producer.protocol.lanes``)."""
    return resolve_layout(r).streams(lane)


def stream_of_job(r: redis.Redis, job_id: str, lane: str = "normal") -> str:
    """The lane stream a submitted job was queued on: the lane's one stream, or its shard on a cluster."""
    layout = resolve_layout(r)
    return layout.stream(keys.lane_key(lane, layout.shard_of(job_id)))


def pending_of(r: redis.Redis, lane: str = "normal", group: str = keys.DEFAULT_GROUP) -> dict[str, int]:
    """Entries each consumer holds on a lane (summed over its shards on a cluster)."""
    out: dict[str, int] = {}
    for stream in lane_streams(r, lane):
        try:
            for c in r.xinfo_consumers(stream, group):
                name = c["name"].decode()
                out[name] = out.get(name, 0) + int(c["pending"])
        except redis.ResponseError:
            continue
    return out


def pending_snapshot(r: redis.Redis, lane: str = "normal", group: str = keys.DEFAULT_GROUP) -> dict[str, int] | None:
    """``pending_of`` as of one moment, on a cluster too: there a lane's shards are read one after another, and a
    worker's ack on one shard and its next read on another, landing between two of those reads, were summed as if
    held at once (a full run once saw 12 on a worker that never holds more than 10). A sweep counts only when the
    sweep right after it reads the same; None when the lane kept moving through five sweeps."""
    first = pending_of(r, lane, group)
    for _ in range(5):
        second = pending_of(r, lane, group)
        if second == first:
            return first
        first = second
    return None


def lane_group(r: redis.Redis, lane: str = "normal", group: str = keys.DEFAULT_GROUP) -> dict[str, int | None]:
    """The group's ``entries-read``, ``pending`` and ``lag`` on a lane, summed over its shards
    (``lag`` None when Redis cannot tell it for some shard)."""
    total: dict[str, int | None] = {"entries-read": 0, "pending": 0, "lag": 0}
    for stream in lane_streams(r, lane):
        try:
            groups = [g for g in r.xinfo_groups(stream) if g["name"].decode() == group]
        except redis.ResponseError:
            continue
        for g in groups:
            total["entries-read"] += int(g["entries-read"] or 0)
            total["pending"] += int(g["pending"])
            total["lag"] = None if total["lag"] is None or g["lag"] is None else total["lag"] + int(g["lag"])
    return total


def start_redis_server(workdir: Path, port: int | None = None, *args: str) -> tuple[subprocess.Popen, str]:
    """A private redis-server without persistence on a free loopback port (for restart tests)."""
    import socket

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    client = redis.Redis(port=port)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    wait_for(up, 30, f"redis-server on port {port}")
    client.close()
    return proc, f"redis://127.0.0.1:{port}/0"
