"""``python -m pagestream.worker.readiness``: exit 0 when this host's worker is ready to serve.

A container's (or pod's) health probe: ready means the worker's loop runs (its heartbeat hash
``keys.worker_hash(consumer)`` is fresh in Redis: the control thread refreshes it every second with a
15 s TTL) and, with ``PAGESTREAM_SERVED_MODEL_NAME``, its model is announced (``serve_cli.worker_ready``).
The consumer is ``PAGESTREAM_CONSUMER`` when set, else the worker's default name for PID 1
(``<hostname>-1``: the entrypoint ``exec``s the worker, so it is PID 1 of its container).
Exit status 1 (not ready) with the reason on stderr; 3 when Redis cannot be reached.
"""
from __future__ import annotations

import os
import socket
import sys


def main(argv: list[str] | None = None) -> int:
    import redis

    from pagestream.producer.protocol.redis_conn import connect
    from pagestream.producer.protocol.settings import REDIS_URL_ENV
    from pagestream.worker.serve_cli import worker_ready

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
