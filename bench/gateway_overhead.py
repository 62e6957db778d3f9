"""What the OpenAI gateway adds: the same requests through a direct Producer and through the gateway.

    .venv/bin/python bench/gateway_overhead.py [--redis-url redis://127.0.0.1:6379/15] [--requests 200]

One worker (``--model fake``: the instant fake engine, so everything measured is queue and HTTP)
and one gateway process, both on the given Redis. Phases, in one run:
  1. sequential, non-streaming, max_tokens 8: latency of Producer.submit+result vs
     openai ``completions.create``; p50/p99 of each and of the difference.
  2. sequential, streaming: time to the first token, Producer.stream vs the gateway's SSE.
  3. concurrency sweep: C streaming clients at once (AsyncOpenAI), p99 time to first token;
     the largest C whose p99 stays under 100 ms.
It FLUSHES the Redis db it is given: use a db nobody else uses.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import redis

ROOT = Path(__file__).resolve().parents[1]

from pagestream.producer import Producer  # noqa: E402

MODEL = "fake"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagestream.worker.cli", *cmd], cwd=ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_http(url: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def sequential(p: Producer, c: openai.OpenAI, n: int) -> dict:
    direct, gw, d_first, g_first = [], [], [], []
    for i in range(n):
        t0 = time.perf_counter()
        p.result(p.submit(prompt=f"bench {i}", model=MODEL, max_tokens=8, seed=i), timeout=60)
        direct.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        c.completions.create(model=MODEL, prompt=f"bench {i}", max_tokens=8, seed=i)
        gw.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        next(iter(p.stream(p.submit(prompt=f"first {i}", model=MODEL, max_tokens=8, seed=i), timeout=60)))
        d_first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        stream = c.completions.create(model=MODEL, prompt=f"first {i}", max_tokens=8, seed=i, stream=True)
        next(ch for ch in stream if ch.choices and ch.choices[0].text)
        g_first.append(time.perf_counter() - t0)
        stream.close()
    return {
        "nonstream_direct_ms": {"p50": pct(direct, 0.5), "p99": pct(direct, 0.99)},
        "nonstream_gateway_ms": {"p50": pct(gw, 0.5), "p99": pct(gw, 0.99)},
        "nonstream_added_ms": {"p50": pct(gw, 0.5) - pct(direct, 0.5), "p99": pct(gw, 0.99) - pct(direct, 0.99)},
        "first_token_direct_ms": {"p50": pct(d_first, 0.5), "p99": pct(d_first, 0.99)},
        "first_token_gateway_ms": {"p50": pct(g_first, 0.5), "p99": pct(g_first, 0.99)},
        "first_token_added_ms": {"p50": pct(g_first, 0.5) - pct(d_first, 0.5), "p99": pct(g_first, 0.99) - pct(d_first, 0.99)},
    }


async def concurrent(base_url: str, clients: int, rounds: int) -> dict:
    firsts: list[float] = []
    complete = 0
    errors: list[str] = []

    async def one(ac: openai.AsyncOpenAI, i: int) -> None:
        nonlocal complete
        for k in range(rounds):
            t0 = time.perf_counter()
            try:
                stream = await ac.completions.create(model=MODEL, prompt=f"c{i} r{k}", max_tokens=16, seed=i, stream=True)
                seen = False
                async for ch in stream:
                    if not seen and ch.choices and ch.choices[0].text:
                        firsts.append(time.perf_counter() - t0)
                        seen = True
                complete += 1
            except openai.APIError as exc:  # counted: a sweep row with errors does not qualify
                errors.append(type(exc).__name__)

    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120,
                                  http_client=httpx.AsyncClient(limits=limits, timeout=120)) as ac:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(ac, i) for i in range(clients)))
        wall = time.perf_counter() - t0
    return {"clients": clients, "streams": complete, "errors": len(errors), "first_token_p50_ms": pct(firsts, 0.5),
            "first_token_p99_ms": pct(firsts, 0.99), "streams_per_s": complete / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--sweep", default="8,16,32,64,128,256")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    r = redis.Redis.from_url(args.redis_url)
    r.flushdb()
    logs = Path("/tmp") / f"gateway-bench-{os.getpid()}"
    logs.mkdir(exist_ok=True)
    port = 18000 + os.getpid() % 1000
    worker = start(["worker", "--redis-url", args.redis_url, "--model", "fake", "--served-model-name", MODEL,
                    "--max-num-seqs", "512", "--max-model-len", "4096", "--log-level", "WARNING"], logs / "worker.log")
    gateway = start(["gateway", "--redis-url", args.redis_url, "--port", str(port), "--log-level", "WARNING"], logs / "gateway.log")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        with Producer.from_url(args.redis_url) as p:
            end = time.monotonic() + 60
            while MODEL not in p.live_models() and time.monotonic() < end:
                time.sleep(0.2)
            c = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
            for _ in range(20):  # warm-up (connections, JIT of nothing, caches)
                c.completions.create(model=MODEL, prompt="warm", max_tokens=2)
            out = {"machine": f"{platform.node()} {os.cpu_count()} cores", "requests": args.requests, **sequential(p, c, args.requests)}
        sweep = []
        for n in (int(x) for x in args.sweep.split(",")):
            row = asyncio.run(concurrent(base, n, args.rounds))
            sweep.append(row)
            print(json.dumps(row), flush=True)
        out["sweep"] = sweep
        ok = [row["clients"] for row in sweep if row["first_token_p99_ms"] < 100 and row["streams"] == row["clients"] * args.rounds]
        out["max_clients_p99_first_token_under_100ms"] = max(ok) if ok else 0
        print(json.dumps(out, indent=2))
    finally:
        for proc in (gateway, worker):
            proc.terminate()
            proc.wait(30)
        r.flushdb()


if __name__ == "__main__":
    main()
