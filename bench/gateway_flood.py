"""Issue 37, acceptance 2: a flood of the worst bodies against one gateway, and what it does to everyone else.

Starts a Redis-backed fake-engine worker and `pagestream gateway` on a private db, then for ``--seconds``
has ``--clients`` processes POST, round robin, the bodies that stalled the gateway before the bounds:
a 20,000-prompt list to /v1/completions (for the served model), a million ``{}`` messages (3 MB), a
message of 100,000 content parts, and a million empty prompt lists. Meanwhile this process asks
/health every 20 ms and samples the gateway's RSS. It prints (and writes with ``--out``) /health's
latency percentiles, the gateway's RSS idle and at its peak, the answers' status codes, and how many
jobs Redis holds afterwards (none may come from a refused request).

    python bench/gateway_flood.py --seconds 60 --clients 4 --out bench/results/gateway_flood.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import redis

from pagestream.producer.protocol import keys
from procs import children, free_port, rss_mib

ROOT = Path(__file__).resolve().parents[1]


def bodies(model: str) -> list[tuple[str, bytes]]:
    def enc(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    return [
        ("/v1/completions", enc({"model": model, "prompt": [[1]] * 20_000, "max_tokens": 1})),
        ("/v1/chat/completions", enc({"model": model, "messages": [{}] * 1_000_000})),
        ("/v1/chat/completions", enc({"model": model, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}]})),
        ("/v1/completions", enc({"model": model, "prompt": [[]] * 1_000_000})),
    ]


def flood(base: str, model: str, seconds: float, out: mp.Queue) -> None:
    payloads = bodies(model)
    codes: Counter = Counter()
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=120) as c:
        i = 0
        while time.monotonic() < deadline:
            path, body = payloads[i % len(payloads)]
            i += 1
            try:
                r = c.post(base + path, content=body, headers={"content-type": "application/json"})
                codes[f"{path} {r.status_code}"] += 1
            except httpx.HTTPError as exc:
                codes[f"{path} {type(exc).__name__}"] += 1
    out.put(dict(codes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--checkers", type=int, help="the gateway's body_check_processes (default: its own default)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    r = redis.Redis.from_url(args.redis_url)
    r.flushdb()
    logs = Path(tempfile.mkdtemp(prefix="flood-"))
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.checkers is not None:
        env["PAGESTREAM_GATEWAY_BODY_CHECK_PROCESSES"] = str(args.checkers)
    cli = [sys.executable, "-m", "pagestream.worker.cli"]
    worker = subprocess.Popen([*cli, "worker", "--redis-url", args.redis_url, "--model", "fake:5", "--served-model-name", "flood-model"],
                              cwd=ROOT, env=env, stdout=open(logs / "worker.log", "w"), stderr=subprocess.STDOUT)
    gateway = subprocess.Popen([*cli, "gateway", "--redis-url", args.redis_url, "--port", str(port)],
                               cwd=ROOT, env=env, stdout=open(logs / "gateway.log", "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=5) as c:
            deadline = time.monotonic() + 120
            model = None
            while model is None:
                if time.monotonic() > deadline:
                    raise SystemExit(f"gateway or worker not ready; logs in {logs}")
                try:
                    data = c.get(base + "/v1/models").json().get("data") or []
                    model = data[0]["id"] if data else None
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.2)
            time.sleep(1.0)
            idle = rss_mib(gateway.pid)
            jobs_before = sum(1 for _ in r.scan_iter(match=keys.job_hash("*"), count=1000))
            q: mp.Queue = mp.Queue()
            clients = [mp.Process(target=flood, args=(base, model, args.seconds, q)) for _ in range(args.clients)]
            for p in clients:
                p.start()
            latencies, peak, helpers_peak = [], idle, 0.0
            while any(p.is_alive() for p in clients):
                t0 = time.perf_counter()
                ok = c.get(base + "/health").status_code == 200
                latencies.append((time.perf_counter() - t0) * 1000 if ok else float("inf"))
                peak = max(peak, rss_mib(gateway.pid))
                helpers = 0.0  # the gateway's children: its body checkers
                for child in children(gateway.pid):
                    try:
                        helpers += rss_mib(child)
                    except OSError:  # gone meanwhile
                        pass
                helpers_peak = max(helpers_peak, helpers)
                time.sleep(0.02)
            codes: Counter = Counter()
            for _ in clients:
                codes.update(q.get(timeout=60))
            for p in clients:
                p.join()
            time.sleep(1.0)
            after = rss_mib(gateway.pid)
        jobs_after = sum(1 for _ in r.scan_iter(match=keys.job_hash("*"), count=1000))
        lat = sorted(latencies)
        pct = {f"p{q}": round(lat[min(len(lat) - 1, int(len(lat) * q / 100))], 2) for q in (50, 90, 99)}
        result = {
            "seconds": args.seconds, "clients": args.clients, "health_probes": len(lat),
            "health_ms": {**pct, "max": round(lat[-1], 2)},
            "gateway_rss_mib": {"idle": round(idle, 1), "peak": round(peak, 1), "after": round(after, 1),
                                "peak_over_idle": round(peak / idle, 2), "children_peak": round(helpers_peak, 1)},
            "body_check_processes": args.checkers,
            "answers": dict(sorted(codes.items())),
            "jobs_in_redis": {"before": jobs_before, "after": jobs_after},
            "holds": {"health_p99_under_50ms": pct["p99"] < 50, "rss_under_2x_idle": peak < 2 * idle,
                      "no_job_from_a_refused_request": jobs_after == jobs_before},
        }
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        for p in (gateway, worker):
            p.terminate()
        for p in (gateway, worker):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        r.flushdb()


if __name__ == "__main__":
    main()
