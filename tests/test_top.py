"""``pagestream top`` in a real terminal (issue 27, acceptance 3): tmux runs it, ``capture-pane`` reads the screen; the
queue depth it shows follows jobs being pushed and drained, and the running worker is on it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import pytest
import redis

from gateway_helpers import DB_URL
from queue_helpers import ROOT, WorkerProc, wait_for
from test_observability import require_tool

MODEL = "top-model"


def lane_row(screen: str, model: str, lane: str) -> list[str] | None:
    """The cells of ``model``'s ``lane`` row in the queues table (model, lane, queued, in flight, oldest, workers)."""
    for line in screen.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if len(cells) >= 6 and cells[0] == model and cells[1] == lane:
            return cells
    return None


def worker_row(screen: str, consumer: str) -> list[str] | None:
    for line in screen.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if cells and cells[0] == consumer:
            return cells
    return None


@pytest.fixture
def tmux():
    """A tmux server of this test's own (its own socket), killed after."""
    tool = require_tool("tmux")
    sock = f"pagestream-top-{uuid.uuid4().hex[:8]}"

    def run(*args: str) -> str:
        return subprocess.run([tool, "-L", sock, *args], capture_output=True, text=True, timeout=30, check=True).stdout

    yield run
    subprocess.run([tool, "-L", sock, "kill-server"], capture_output=True, timeout=30)


def test_top_shows_the_live_queue_depth_and_a_running_worker(tmux, tmp_path):
    from pagestream.producer import Producer
    from pagestream.producer.protocol.schema import JobRequest

    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    consumer = f"top-w-{uuid.uuid4().hex[:6]}"
    # two slots, 40 ms a token: 12 jobs of 30 tokens take ~7 s to drain, long enough to watch the queue
    worker = WorkerProc(DB_URL, "fake:40", consumer, "--served-model-name", MODEL, "--max-num-seqs", "2",
                        log_dir=tmp_path)
    try:
        worker.wait_ready()
        producer = Producer(r)
        wait_for(lambda: MODEL in producer.live_models(), 60, "the worker's announcement")
        env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1", "TERM": "xterm-256color"}
        cmd = " ".join([*(f"{k}={v}" for k, v in env.items() if v), sys.executable, "-m", "pagestream.worker.cli",
                        "top", "--redis-url", DB_URL, "--interval", "0.3"])
        # the pane stays after top exits, so a crash shows on the captured screen
        tmux("new-session", "-d", "-s", "top", "-x", "160", "-y", "60", "-c", str(ROOT))
        tmux("set-option", "-t", "top", "remain-on-exit", "on")
        tmux("respawn-pane", "-k", "-t", "top", f"env -u COLUMNS -u LINES {cmd}")  # the pane's own size

        last = [""]

        def screen() -> str:
            last[0] = tmux("capture-pane", "-p", "-t", "top")
            return last[0]

        def wait_screen(cond, timeout: float, what: str) -> None:
            try:
                wait_for(cond, timeout, what, interval=0.2)
            except TimeoutError as exc:
                raise AssertionError(f"{exc}; the screen:\n{last[0]}") from None

        # the worker is on screen, idle, and the model's queue is empty
        wait_screen(lambda: (worker_row(screen(), consumer) or [None, None])[1] == MODEL, 60, "the worker's row")
        wait_screen(lambda: (lane_row(screen(), MODEL, "normal") or [""] * 3)[2] == "0", 30, "an empty queue")

        ids = [producer.submit(JobRequest(prompt=f"job {i}", max_tokens=30, model=MODEL)) for i in range(12)]
        seen_depths, seen_running = set(), set()

        def watch() -> bool:
            s = screen()
            row, wrow = lane_row(s, MODEL, "normal"), worker_row(s, consumer)
            if row:
                seen_depths.add(int(row[2]))
            if wrow and wrow[2].isdigit():
                seen_running.add(int(wrow[2]))
            return bool(row) and int(row[2]) > 0

        wait_screen(watch, 30, "a queued depth on screen")
        depth_on_screen = max(seen_depths)
        # at most what was pushed, less what the worker's two slots took
        assert 1 <= depth_on_screen <= 12
        # the queue drains live, without restarting top, and the worker was seen running jobs
        wait_screen(lambda: watch() is False and 0 in seen_depths and {1, 2} & seen_running, 60,
                    "the queue draining on screen and the worker running jobs")
        assert len(seen_depths) >= 3, sorted(seen_depths)  # it moved through values, not one jump
        assert all(producer.result(j, timeout=30).status.value == "completed" for j in ids)
        # the worker's completed count on screen follows
        wait_screen(lambda: int((worker_row(screen(), consumer) or ["0"] * 7)[6]) >= 12, 30, "done >= 12")
    finally:
        worker.stop()
        r.flushdb()
        r.close()


def test_top_once_prints_one_frame_and_exits(tmp_path):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    try:
        from pagestream.producer import Producer
        from pagestream.producer.protocol.schema import JobRequest

        # a model whose worker has stopped: its queued job is on the frame
        consumer = f"top-once-{uuid.uuid4().hex[:6]}"
        worker = WorkerProc(DB_URL, "fake:5", consumer, "--served-model-name", "gone-model", log_dir=tmp_path)
        worker.wait_ready()
        wait_for(lambda: "gone-model" in Producer(r).live_models(), 60, "announcement")
        worker.stop()
        Producer(r).submit(JobRequest(prompt="x", max_tokens=1, model="gone-model"), queue_unserved=True)
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "pagestream.worker.cli", "top", "--redis-url", DB_URL, "--once"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, "COLUMNS": "160"})
        assert out.returncode == 0, out.stderr
        assert time.monotonic() - t0 < 30
        row = lane_row(out.stdout, "gone-model", "normal")
        assert row is not None and row[2] == "1", out.stdout
        assert row[4] != "-", out.stdout  # the oldest job's age
    finally:
        r.flushdb()
        r.close()
