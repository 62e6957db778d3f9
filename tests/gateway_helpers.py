"""A gateway as a separate process (``pagestream gateway``), for the tests that drive it with the openai client."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import httpx

from private_redis import free_port
from queue_helpers import ROOT, wait_for

#: the test Redis db (PAGESTREAM_TEST_REDIS_DB) the gateway tests flush
DB_URL = f"redis://{os.environ.get('PAGESTREAM_TEST_REDIS_HOST', '127.0.0.1')}:{os.environ.get('PAGESTREAM_TEST_REDIS_PORT', '6379')}/{os.environ.get('PAGESTREAM_TEST_REDIS_DB', '9')}"


class GatewayProc:
    def __init__(self, redis_url: str, *args: str, log_dir: Path, env: dict | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_dir / f"gateway-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "pagestream.worker.cli", "gateway", "--redis-url", redis_url, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"gateway exited:\n{self.log()}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 60.0) -> None:
        wait_for(self.healthy, timeout, "gateway /health", interval=0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def batch_stack(log_dir: Path, files_dir: Path, model: str, consumer: str, *gateway_args: str, gateway_env: dict | None = None):
    """A fake-engine worker serving ``model``, a gateway keeping files in ``files_dir`` and a bulk-worker,
    on the test db (flushed before and after); yields ``{"gw", "r", "log_dir"}`` once the model is announced."""
    import redis

    from pagestream.producer import Producer
    from queue_helpers import WorkerProc

    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    worker = WorkerProc(DB_URL, "fake:5", consumer, "--served-model-name", model, "--max-model-len", "128",
                        log_dir=log_dir, env={"PAGESTREAM_BULK_FLUSH_INTERVAL_S": "0.2"})
    gw = GatewayProc(DB_URL, *gateway_args, log_dir=log_dir,
                     env={"PAGESTREAM_GATEWAY_FILES_URI": str(files_dir), **(gateway_env or {})})
    bulk_log = open(log_dir / "bulk-worker.log", "w")
    bulk_worker = subprocess.Popen([sys.executable, "-m", "pagestream.worker.cli", "bulk-worker", "--redis-url", DB_URL],
                                   cwd=ROOT, stdout=bulk_log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        worker.wait_ready()
        gw.wait_ready()
        wait_for(lambda: model in Producer(r).live_models(), 60, "the worker's announcement")
        yield {"gw": gw, "r": r, "log_dir": log_dir}
    finally:
        gw.stop()
        worker.stop()
        bulk_worker.terminate()
        try:
            bulk_worker.wait(30)
        except subprocess.TimeoutExpired:
            bulk_worker.kill()
            bulk_worker.wait(10)
        bulk_log.close()
        r.flushdb()
        r.close()
