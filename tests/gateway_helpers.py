"""A gateway as a separate process (``pagestream gateway``), for the tests that drive it with the openai client."""
from __future__ import annotations

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
