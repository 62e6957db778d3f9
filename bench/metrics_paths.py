"""Issue 22, acceptance 3: 20,000 keyless requests to random paths against a gateway with API keys.

    .venv/bin/python bench/metrics_paths.py --requests 20000 --clients 4 --out bench/results/metrics_paths.json

Starts `pagestream gateway --api-keys ...` on a private Redis db; warms it with 400 requests of every shape
(the series that can ever exist), then ``--clients`` processes send ``--requests`` keyless requests in
total to random paths (unknown paths, real route templates with fresh ids, wrong methods: 401/404/405)
while this process asks /health every 20 ms and scrapes /metrics every 0.5 s. Reported: /metrics size and
gateway RSS after the warm-up and at the end (acceptance: within 10%), scrape and /health latency
percentiles over the whole run (acceptance: scrape under 50 ms, /health under 20 ms), and the answers'
status codes (never a 5xx). Before the fix, 12,000 such requests grew /metrics to 71 MB and a scrape took 6 s.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import string
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import redis
from procs import free_port, rss_mib

ROOT = Path(__file__).resolve().parents[1]


def random_paths(seed: int, n: int):
    rng = random.Random(seed)
    word = lambda k: "".join(rng.choices(string.ascii_lowercase + string.digits, k=k))  # noqa: E731
    shapes = [
        lambda: ("GET", f"/{word(12)}/{word(8)}"),
        lambda: ("POST", f"/v1/{word(10)}"),
        lambda: ("GET", f"/v1/files/file-{word(24)}"),
        lambda: ("GET", f"/v1/files/file-{word(24)}/content"),
        lambda: ("DELETE", f"/v1/batches/batch_{word(24)}"),
        lambda: ("POST", f"/v1/batches/batch_{word(24)}/cancel"),
        lambda: ("GET", f"/v1/models/{word(6)}?x={word(5)}"),
        lambda: ("GET", f"/v1/streams/{word(32)}"),
    ]
    for _ in range(n):
        yield rng.choice(shapes)()


def blast(base: str, seed: int, n: int, out: mp.Queue) -> None:
    codes: Counter = Counter()
    with httpx.Client(base_url=base, timeout=30) as c:
        for method, path in random_paths(seed, n):
            try:
                codes[c.request(method, path).status_code] += 1
            except httpx.HTTPError as exc:
                codes[type(exc).__name__] += 1
    out.put(dict(codes))


def pct(values: list[float]) -> dict:
    v = sorted(values)
    return {**{f"p{q}": round(v[min(len(v) - 1, int(len(v) * q / 100))], 2) for q in (50, 90, 99)}, "max": round(v[-1], 2),
            "n": len(v)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/13", help="a db this FLUSHES")
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    r = redis.Redis.from_url(args.redis_url)
    r.flushdb()
    logs = Path(tempfile.mkdtemp(prefix="metrics-paths-"))
    port = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "pagestream.worker.cli", "gateway", "--redis-url", args.redis_url,
                                "--port", str(port), "--api-keys", "bench-key-1:team"],
                               cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               stdout=open(logs / "gateway.log", "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=30) as c:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or gateway.poll() is not None:
                    raise SystemExit(f"gateway not ready; log in {logs}")
                time.sleep(0.2)
            q: mp.Queue = mp.Queue()
            blast(base, 0, 400, q)  # every shape seen: the series that can ever exist
            warm_codes = q.get()
            c.get("/metrics")
            warm_size, warm_rss = len(c.get("/metrics").content), rss_mib(gateway.pid)
            per = args.requests // args.clients
            clients = [mp.Process(target=blast, args=(base, 1 + i, per, q)) for i in range(args.clients)]
            start = time.monotonic()
            for p in clients:
                p.start()
            health, scrapes, next_scrape = [], [], 0.0
            while any(p.is_alive() for p in clients):
                t0 = time.perf_counter()
                ok = c.get("/health").status_code == 200
                health.append((time.perf_counter() - t0) * 1000 if ok else float("inf"))
                if time.monotonic() >= next_scrape:
                    t0 = time.perf_counter()
                    c.get("/metrics")
                    scrapes.append((time.perf_counter() - t0) * 1000)
                    next_scrape = time.monotonic() + 0.5
                time.sleep(0.02)
            wall = time.monotonic() - start
            codes: Counter = Counter()
            for _ in clients:
                codes.update(q.get(timeout=60))
            for p in clients:
                p.join()
            end_text = c.get("/metrics").text
            end_size, end_rss = len(end_text.encode()), rss_mib(gateway.pid)
            series = sum(1 for line in end_text.splitlines() if line and not line.startswith("#"))
        result = {
            "argv": sys.argv, "machine": f"{platform.node()}, {os.cpu_count()} CPUs", "requests": per * args.clients,
            "clients": args.clients, "wall_s": round(wall, 1), "requests_per_s": round(per * args.clients / wall, 1),
            "metrics_bytes": {"warm": warm_size, "end": end_size, "ratio": round(end_size / warm_size, 3)},
            "metrics_samples_end": series,
            "gateway_rss_mib": {"warm": round(warm_rss, 1), "end": round(end_rss, 1), "ratio": round(end_rss / warm_rss, 3)},
            "scrape_ms": pct(scrapes), "health_ms": pct(health),
            "answers": {str(k): v for k, v in sorted(codes.items(), key=str)}, "warm_answers": {str(k): v for k, v in warm_codes.items()},
        }
        print(json.dumps(result, indent=1))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        gateway.terminate()
        gateway.wait(30)
        r.flushdb()


if __name__ == "__main__":
    main()
