"""A gateway as a separate process (``pagestream gateway``), for the tests that drive it with the openai client."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from private_redis import free_port
from queue_helpers import ROOT, wait_for
from zygote import spawn

#: the test Redis db (PAGESTREAM_TEST_REDIS_DB) the gateway tests flush
DB_URL = f"redis://{os.environ.get('PAGESTREAM_TEST_REDIS_HOST', '127.0.0.1')}:{os.environ.get('PAGESTREAM_TEST_REDIS_PORT', '6379')}/{os.environ.get('PAGESTREAM_TEST_REDIS_DB', '9')}"


_HEALTH = httpx.Client(timeout=5)  # one client for every readiness poll: each new client builds an SSL context (33 ms)


def health_ok(port: int) -> bool:
    try:
        return _HEALTH.get(f"http://127.0.0.1:{port}/health").status_code == 200
    except httpx.HTTPError:
        return False


class GatewayProc:
    def __init__(self, redis_url: str, *args: str, log_dir: Path, env: dict | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_dir / f"gateway-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "pagestream.worker.cli", "gateway", "--redis-url", redis_url, "--port", str(self.port), *args]
        self.proc = spawn(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"gateway exited:\n{self.log()}")
        return health_ok(self.port)

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


class ServeProc:
    """``pagestream serve MODEL`` as a process on a free port, in a session of its own: a stop that overruns
    kills the whole group (worker and bulk-worker too) and fails the test with the log, so no child is
    left consuming the test db for the tests after it."""

    def __init__(self, model, *args: str, log_dir: Path, redis_url: str | None = DB_URL, env: dict | None = None) -> None:
        """``redis_url=None``: serve starts its embedded Redis; an ``env`` value of None unsets that variable."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_dir / f"serve-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "pagestream.worker.cli", "serve", str(model), "--port", str(self.port), "--device", "cpu", *args]
        if redis_url is not None:
            cmd += ["--redis-url", redis_url]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}  # None: unset
        self.proc = spawn(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                          env={k: v for k, v in full_env.items() if v is not None})

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"serve exited:\n{self.log()}")
        return health_ok(self.port)

    def wait_ready(self, timeout: float = 300.0) -> None:
        wait_for(self.healthy, timeout, "pagestream serve's /health", interval=0.3)

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM, as a supervisor stops it; its exit status. Past ``timeout`` the group is killed and the
        test fails: a serve that does not stop on SIGTERM is a bug a user would see."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    return self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    # what it is stuck on: the gateway writes every thread's and task's stack on SIGUSR1
                    with contextlib.suppress(ProcessLookupError):
                        self.proc.send_signal(signal.SIGUSR1)
                    time.sleep(3)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
                    raise AssertionError(f"serve did not stop within {timeout}s of SIGTERM:\n{self.log()[-12000:]}") from None
            return self.proc.returncode
        finally:
            with contextlib.suppress(ProcessLookupError):  # anything of its group still there
                os.killpg(self.proc.pid, signal.SIGKILL)
            self._log.close()


def openai_client(gw: "GatewayProc", key: str = "none", timeout: float = 120):
    """The official openai client on a gateway: no retries (a test sees every answer), ``key`` as its Bearer."""
    import openai

    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0, timeout=timeout)


def read_sse(source, stop_after: int | None = None) -> list[dict]:
    """The SSE events of an httpx streaming response (or of its ``iter_lines()``, to read on later), each a
    dict of its fields (``id``, ``data``); with ``stop_after``, stop reading once that many arrived (the
    caller then reads on, hangs up or kills the server)."""
    lines = source.iter_lines() if hasattr(source, "iter_lines") else source
    events, current = [], {}
    for line in lines:
        if not line:
            if current:
                events.append(current)
            current = {}
            if stop_after is not None and len(events) == stop_after:
                break
            continue
        name, _, value = line.partition(":")
        current[name] = value.lstrip(" ")
    return events


@contextlib.contextmanager
def gateway_stack(redis_url: str, log_dir: Path, model: str, consumer: str, *worker_args: str, engine: str = "fake:5",
                  gateway_args: tuple[str, ...] = (), gateway_env: dict | None = None, worker_env: dict | None = None,
                  flush: bool = True):
    """A fake-engine worker serving ``model`` (``engine``: ``fake:<ms a step>``) and a gateway on ``redis_url``
    (its db flushed before and after unless ``flush`` is off); yields ``{"gw", "worker", "r", "log_dir"}`` once
    the worker's model is announced."""
    import redis

    from pagestream.producer import Producer
    from queue_helpers import WorkerProc

    r = redis.Redis.from_url(redis_url)
    if flush:
        r.flushdb()
    worker = WorkerProc(redis_url, engine, consumer, "--served-model-name", model, *worker_args, log_dir=log_dir,
                        env=worker_env)
    gw = GatewayProc(redis_url, *gateway_args, log_dir=log_dir, env=gateway_env)
    try:
        worker.wait_ready()
        gw.wait_ready()
        wait_for(lambda: model in Producer(r).live_models(), 60, "the worker's announcement")
        yield {"gw": gw, "worker": worker, "r": r, "log_dir": log_dir}
    finally:
        gw.stop()
        worker.stop()
        if flush:
            r.flushdb()
        r.close()


@contextlib.contextmanager
def batch_stack(log_dir: Path, files_dir: Path, model: str, consumer: str, *gateway_args: str, gateway_env: dict | None = None,
                engine: str = "fake:5", worker_args: tuple[str, ...] = ("--max-model-len", "128")):
    """``gateway_stack`` on the test db with the gateway keeping files in ``files_dir``, plus a bulk-worker;
    yields ``{"gw", "worker", "r", "log_dir"}`` once the model is announced."""
    bulk_log = open(log_dir / "bulk-worker.log", "w")
    bulk_worker = None
    try:
        with gateway_stack(DB_URL, log_dir, model, consumer, *worker_args, engine=engine, gateway_args=gateway_args,
                           gateway_env={"PAGESTREAM_GATEWAY_FILES_URI": str(files_dir), **(gateway_env or {})},
                           worker_env={"PAGESTREAM_BULK_FLUSH_INTERVAL_S": "0.2"}) as s:
            bulk_worker = spawn([sys.executable, "-m", "pagestream.worker.cli", "bulk-worker", "--redis-url", DB_URL],
                                           cwd=ROOT, stdout=bulk_log, stderr=subprocess.STDOUT,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
            yield s
            bulk_worker.terminate()
            try:
                bulk_worker.wait(30)
            except subprocess.TimeoutExpired:
                bulk_worker.kill()
                bulk_worker.wait(10)
    finally:
        if bulk_worker is not None and bulk_worker.poll() is None:
            bulk_worker.kill()
            bulk_worker.wait(10)
        bulk_log.close()
