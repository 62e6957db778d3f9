"""``python -m pagestream.worker.readiness``: exit 0 when this host's worker is ready to serve.

A container's (or pod's) health probe: ready means the worker's loop runs (its heartbeat hash
``keys.worker_hash(consumer)`` is fresh in Redis: the control thread refreshes it every second with a
15 s TTL) and, with ``PAGESTREAM_SERVED_MODEL_NAME``, its model is announced (``worker_ready``; ``pagestream serve`` and the demo wait on it too).
The consumer is ``PAGESTREAM_CONSUMER`` when set, else the worker's default name for PID 1
(``<hostname>-1``: the entrypoint ``exec``s the worker, so it is PID 1 of its container).
Exit status 1 (not ready) with the reason on stderr; 3 when Redis cannot be reached.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from pagestream.producer.protocol import keys

READY_TIMEOUT_S = 900.0


def worker_ready(client, consumer: str, model: str | None, now_s: float | None = None) -> bool:
    """Whether worker ``consumer`` runs its loop (its heartbeat hash exists) and, when it serves
    ``model``, has announced it (an unexpired entry in the model registry)."""
    if not client.exists(keys.worker_hash(consumer)):
        return False
    if model is None:
        return True
    until_ms = client.zscore(keys.model_registry(), model)
    now_ms = (now_s if now_s is not None else time.time()) * 1000
    return until_ms is not None and until_ms > now_ms


def wait_ready(client, consumer: str, model: str | None, proc: subprocess.Popen, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Block until ``worker_ready``; ``RuntimeError`` if ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not worker_ready(client, consumer, model):
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited (status {proc.returncode}) before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker was not ready after {timeout_s:.0f} s")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    import redis

    from pagestream.producer.protocol.redis_conn import connect
    from pagestream.producer.protocol.settings import REDIS_URL_ENV

    url = next((os.environ[e] for e in REDIS_URL_ENV if os.environ.get(e)), "redis://localhost:6379/0")
    consumer = os.environ.get("PAGESTREAM_CONSUMER") or f"{socket.gethostname()}-1"
    model = os.environ.get("PAGESTREAM_SERVED_MODEL_NAME") or None
    try:
        client = connect(url, socket_connect_timeout=3, socket_timeout=3)
        if worker_ready(client, consumer, model):
            return 0
    except (redis.RedisError, OSError) as exc:
        print(f"not ready: cannot reach Redis ({exc})", file=sys.stderr)
        return 3
    print(f"not ready: no heartbeat from worker {consumer}" + (f" announcing {model!r}" if model else ""), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
