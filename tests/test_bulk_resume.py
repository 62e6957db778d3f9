"""Crash and resume (acceptance 2): kill -9 a worker that has flushed parts and the RQ worker
running the orchestrator, mid-run; after restart the bulk completes with one line per custom_id."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pagestream.producer.protocol import keys
from pagestream.producer.bulk.api import get_bulk, submit_bulk
from test_bulk import read_jsonl, write_input
from zygote import spawn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def spawn_bulk_worker(redis_url: str, env: dict, concurrency: int = 1, log: Path | None = None) -> subprocess.Popen:
    """A bulk-worker; its output goes to ``log`` (kept for a failure's report) or nowhere."""
    code = "import typer; from pagestream.producer.bulk.cli import bulk_worker; typer.run(bulk_worker)"
    out = open(log, "wb") if log else subprocess.DEVNULL
    try:
        return spawn([sys.executable, "-c", code, "--redis-url", redis_url, "--rescue-interval-s", "1",
                                 "--concurrency", str(concurrency)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log:
            out.close()


def spawn_standin(redis_url: str, consumer: str, env: dict, delay_s: float = 0.05) -> subprocess.Popen:
    return spawn([sys.executable, str(HERE / "test_bulk_support.py"), "standin", "--redis-url", redis_url,
                             "--consumer", consumer, "--flush-lines", "40", "--flush-interval-s", "0.3",
                             "--delay-s", str(delay_s)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _bulk_worker_pids(redis_url: str) -> list[int]:
    """Live processes running a bulk-worker for ``redis_url`` (any process of its tree: pool, workers, scheduler)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            state = next(line for line in (d / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, ValueError, StopIteration):
            continue
        if b"typer.run(bulk_worker)" in b" ".join(cmd) and redis_url.encode() in cmd and "zombie" not in state:
            pids.append(int(d.name))
    return pids


def wait_for(pred, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(what)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_kill9_worker_and_orchestrator_then_resume(redis_url, tmp_path, concurrency):
    """concurrency 4: rq's WorkerPool; kill -9 of it takes its orchestrators with it (parent-death signal)."""
    env = {**os.environ, "PAGESTREAM_BULK_LEASE_S": "3", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    inp = tmp_path / "in.jsonl"
    expected = write_input(inp, 3000, bad_every=100)
    out = tmp_path / "out"
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    procs = {"orch": spawn_bulk_worker(redis_url, env, concurrency, tmp_path / "orch.log"), "w0": spawn_standin(redis_url, "w0", env),
             "w1": spawn_standin(redis_url, "w1", env)}
    try:
        bulk_id = submit_bulk(str(inp), str(out), redis_url=redis_url, max_outstanding=300, shard_lines=1000)
        key = keys.bulk_hash(bulk_id)
        wait_for(lambda: (out / "parts").is_dir() and any(p.name.startswith("w0-") for p in (out / "parts").iterdir())
                 and int(r.hget(key, "line") or 0) > 0, 60, "w0 flushed a part")
        assert r.hget(key, "input_done") is None  # mid-run: the orchestrator is still feeding
        for name in ("w0", "orch"):
            procs[name].send_signal(signal.SIGKILL)
            procs[name].wait()
        killed_at_line = int(r.hget(key, "line"))
        unacked = r.xpending(keys.jobs_stream("low"), keys.DEFAULT_GROUP)["pending"]
        procs["orch2"] = spawn_bulk_worker(redis_url, env, concurrency, tmp_path / "orch2.log")
        procs["w2"] = spawn_standin(redis_url, "w2", env, delay_s=0.0)
        try:
            wait_for(lambda: get_bulk(r, bulk_id)["status"] in ("completed", "failed"), 180, "bulk final")
        except TimeoutError:
            tails = {n: (tmp_path / n).read_text(errors="replace")[-3000:] for n in ("orch.log", "orch2.log")}
            raise TimeoutError(f"bulk not final: {get_bulk(r, bulk_id)}; {r.hgetall(key)}; bulk-worker logs: {tails}")
        st = get_bulk(r, bulk_id)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    assert st["status"] == "completed", st
    # nothing of a killed bulk-worker lives on (a pool's RQ scheduler process once did, orphaned)
    wait_for(lambda: not _bulk_worker_pids(redis_url), 15, "every bulk-worker process gone")
    assert 0 < killed_at_line < 3000 and unacked > 0
    if concurrency == 1:  # the pool's RQ re-queues its dead worker's job itself (Retry), before the rescue looks
        assert int(r.hget(keys.bulk_hash(bulk_id), "restarts")) >= 1  # the orchestrator was re-enqueued
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["request_counts"] == {"total": 3000, "completed": 2970, "failed": 30}
    lines = []
    for shard in manifest["output_shards"]:
        lines += read_jsonl((out / shard["name"]).read_bytes())
    ids = [x["custom_id"] for x in lines]
    assert len(ids) == len(set(ids)) and set(ids) == set(expected)
    errors = read_jsonl((out / "errors-00000.jsonl").read_bytes())
    assert [e["error"]["line"] for e in errors] == list(range(100, 3001, 100))
    assert not (out / "parts").exists()
