"""A Redis outage in the middle of a bulk (issue 8, item 6).

A redis-server of the test's own (a free loopback port, AOF with fsync always, so what
was acknowledged survives ``kill -9``) is killed while ``pagestream bulk-worker`` feeds a
bulk to a worker process, stays down 6 s (twice the orchestrator's lease) and is
started again on the same files. The bulk-worker and the worker keep running, and the
bulk completes exactly once: one output line per custom_id.
"""
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
from test_bulk_support import free_port
from tests.queue_helpers import ROOT, WorkerProc, wait_for
from zygote import spawn

OUTAGE_S = 6.0  # twice the orchestrator's lease (PAGESTREAM_BULK_LEASE_S below)


class RedisServer:
    """A redis-server process of our own whose data survives a kill -9 (AOF, appendfsync always)."""

    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.dir = data_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/11"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no"],
            stdout=open(self.dir / "redis.log", "a"), stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        wait_for(lambda: self._pings(client), 30, f"redis-server on {self.port}")

    @staticmethod
    def _pings(client: redis.Redis) -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def own_redis(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    if server.proc.poll() is None:
        server.proc.terminate()
        server.proc.wait(10)


def test_bulk_worker_rides_out_a_redis_outage_and_the_bulk_completes_exactly_once(own_redis, tmp_path):
    env = {**os.environ, "PAGESTREAM_BULK_LEASE_S": "3", "PAGESTREAM_BULK_FLUSH_LINES": "40",
           "PAGESTREAM_BULK_FLUSH_INTERVAL_S": "0.5", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    expected = write_input(inp, 1500, bad_every=100)
    r = redis.Redis.from_url(own_redis.url, decode_responses=True)
    orch_log = open(tmp_path / "bulk-worker.log", "w")
    orch = spawn([sys.executable, "-m", "pagestream.worker.cli", "bulk-worker", "--redis-url", own_redis.url,
                             "--rescue-interval-s", "1"], cwd=ROOT, env=env, stdout=orch_log, stderr=subprocess.STDOUT)
    worker = WorkerProc(own_redis.url, "fake:5", "outage-w", "--lanes", "low", "--lease-ms", "3000",
                        log_dir=tmp_path, env=env)
    try:
        worker.wait_ready(60)
        bulk_id = submit_bulk(str(inp), str(out), redis_url=own_redis.url, max_outstanding=200, shard_lines=500)
        key = keys.bulk_hash(bulk_id)
        wait_for(lambda: int(r.hget(key, "completed") or 0) >= 100, 120, "100 lines done before the outage")
        assert r.hget(key, "input_done") is None  # the orchestrator is mid-feed

        own_redis.kill9()
        time.sleep(OUTAGE_S)
        assert orch.poll() is None, (tmp_path / "bulk-worker.log").read_text()[-3000:]
        own_redis.start()

        wait_for(lambda: get_bulk(r, bulk_id)["status"] in ("completed", "failed"), 300, "the bulk to end")
        st = get_bulk(r, bulk_id)
        assert orch.poll() is None and worker.proc.poll() is None  # both kept serving
    finally:
        if orch.poll() is None:
            orch.terminate()
            try:
                orch.wait(30)
            except subprocess.TimeoutExpired:
                orch.kill()
        orch_log.close()
        worker.stop()
    assert st["status"] == "completed", (st, (tmp_path / "bulk-worker.log").read_text()[-3000:])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["request_counts"] == {"total": 1500, "completed": 1485, "failed": 15}
    ids = [rec["custom_id"] for shard in manifest["output_shards"] for rec in read_jsonl((out / shard["name"]).read_bytes())]
    assert len(ids) == len(set(ids)) and set(ids) == set(expected)  # exactly once
    errors = read_jsonl((out / "errors-00000.jsonl").read_bytes())
    assert [e["error"]["line"] for e in errors] == list(range(100, 1501, 100))
