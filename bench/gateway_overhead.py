"""What the OpenAI gateway adds: the same requests through a direct Producer and through the gateway.

    .venv/bin/python bench/gateway_overhead.py [--redis-url redis://127.0.0.1:6379/15] [--requests 200]
        [--sweep 8,16,32,64,128,256] [--rounds 4] [--client-procs N] [--sweep-tokens 16] [--sweep-step-ms 0]

One worker (``--model fake``: the instant fake engine, so everything measured is queue
and HTTP) and one gateway process, both on the given Redis. Phases, in one run:
  1. sequential, non-streaming, max_tokens 8: latency of Producer.submit+result vs
     openai ``completions.create``; p50/p99 of each and of the difference.
  2. sequential, streaming: time to the first token, Producer.stream vs the gateway's SSE.
  3. concurrency sweep: C streaming clients at once, each ``rounds`` requests of 16 tokens one
     after the other (so about C streams are open at any time); p50/p99 time to first token over
     the rounds after the first (the first round, every client connecting at the same instant, is
     reported apart as ``first_round_p99_ms``), streams/s, and the CPU each process used (gateway,
     worker, Redis, the client processes) as % of one core over the row's wall time; the largest
     C whose p99 stays under 100 ms with every stream complete and exact. ``*_wait_for_cpu_pct`` is
     the time a process was ready to run but waited for a core: where it is high, the machine is
     oversubscribed and the latencies measure the machine.
``--sweep-step-ms N`` runs the sweep on a second worker whose fake engine takes N ms a step
instead, so each stream stays open and gets its tokens over time (the gateway's cost per token
event, not per request). The sweep's clients are raw httpx streams (one connection each, SSE lines parsed with ``json``)
spread over ``--client-procs`` processes, so the load generator is not what is measured: one
process of 64 ``AsyncOpenAI`` clients spent its core in httpcore's pool and the SDK's per-chunk
parsing and was the limit (BENCHMARKS.md, "Gateway"). The official client drives phases 1-2
and tests/test_gateway.py.
It FLUSHES the Redis db it is given: use a db nobody else uses.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
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
from pagestream.worker.fake_engine import FakeEngine  # noqa: E402
from procs import cpu_s  # noqa: E402

MODEL = "fake"
SWEEP_TOKENS = 16


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
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


def cpu_wait_s(pid: int) -> float:
    """Seconds a process's threads have been runnable but waiting for a core (Linux schedstat; NaN
    elsewhere): high means the machine, not the process, set its pace."""
    total = 0.0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")
    return total


def redis_cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def accelerators() -> dict[str, bool]:
    """The optional C speedups the gateway picks up when installed (uvicorn: httptools, uvloop; redis-py: hiredis)."""
    import importlib.util

    return {name: importlib.util.find_spec(name) is not None for name in ("httptools", "uvloop", "hiredis")}


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


# ---- the concurrency sweep's load generator (runs in client processes) ----------------------------

async def _stream_once(http: httpx.AsyncClient, model: str, tokens: int, i: int, k: int, expect: str) -> tuple[float | None, str | None]:
    """One streaming completion: (seconds to the first text, None) or (..., what went wrong)."""
    body = {"model": model, "prompt": f"c{i} r{k}", "max_tokens": tokens, "seed": i, "stream": True}
    t0 = time.perf_counter()
    first = None
    text: list[str] = []
    done = False
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return None, f"HTTP {resp.status_code}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            ch = json.loads(data)
            if "error" in ch:
                return first, f"error event {ch['error'].get('code')}"
            t = ch["choices"][0]["text"] if ch.get("choices") else ""
            if t and first is None:
                first = time.perf_counter() - t0
            text.append(t)
    if not done:
        return first, "no [DONE]"
    return first, None if "".join(text) == expect else "wrong text"


async def _clients(base_url: str, model: str, tokens: int, ids: list[int], rounds: int, conn) -> tuple[list[tuple[int, float]], int, list[str], float]:
    firsts: list[tuple[int, float]] = []  # (round, seconds to the first text)
    errors: list[str] = []
    complete = 0
    fake = FakeEngine()
    # a connection of its own per client, as separate users have (one pool of many connections costs
    # the client O(connections) per request: httpcore scans its pool); made before the start, since
    # making an httpx client (its TLS context) costs milliseconds of CPU
    https = [httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=1)) for _ in ids]

    async def one(i: int, http: httpx.AsyncClient) -> None:
        nonlocal complete
        for k in range(rounds):
            try:
                first, err = await _stream_once(http, model, tokens, i, k, fake.expected_text(f"c{i} r{k}", i, tokens))
            except httpx.HTTPError as exc:
                first, err = None, type(exc).__name__
            if first is not None:
                firsts.append((k, first))
            if err is None:
                complete += 1
            else:
                errors.append(err)

    conn.send("ready")
    conn.recv()  # go: every client process starts at once
    t0, w0 = os.times(), cpu_wait_s(os.getpid())
    await asyncio.gather(*(one(i, http) for i, http in zip(ids, https)))
    t1, w1, end = os.times(), cpu_wait_s(os.getpid()), time.perf_counter()
    for http in https:
        await http.aclose()
    return firsts, complete, errors, (t1.user - t0.user) + (t1.system - t0.system), w1 - w0, end


def _client_proc(base_url: str, model: str, tokens: int, ids: list[int], rounds: int, conn) -> None:
    conn.send(asyncio.run(_clients(base_url, model, tokens, ids, rounds, conn)))
    conn.close()


def concurrent(base_url: str, model: str, tokens: int, clients: int, rounds: int, procs: int, pids: dict[str, int],
               r: redis.Redis) -> dict:
    """C clients over ``procs`` processes; per-process CPU as % of one core over the row's wall time."""
    procs = max(1, min(procs, clients))
    ctx = mp.get_context("spawn")
    children = []
    for p in range(procs):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_client_proc, args=(base_url, model, tokens, list(range(p, clients, procs)), rounds, child), daemon=True)
        proc.start()
        children.append((proc, parent))
    for _, parent in children:
        assert parent.recv() == "ready"
    cpu0 = {name: cpu_s(pid) for name, pid in pids.items()}
    wait0 = {name: cpu_wait_s(pid) for name, pid in pids.items()}
    redis0 = redis_cpu_s(r)
    t0 = time.perf_counter()
    for _, parent in children:
        parent.send("go")
    firsts: list[tuple[int, float]] = []
    complete, errors, client_cpu, client_wait, end = 0, [], 0.0, 0.0, t0
    for proc, parent in children:
        f, c, e, cpu, wait, proc_end = parent.recv()
        end = max(end, proc_end)  # perf_counter is the system's monotonic clock: one for every process
        firsts += f
        complete += c
        errors += e
        client_cpu += cpu
        client_wait += wait
        proc.join(30)
    wall = end - t0  # to the last stream's end, not to the clients' teardown
    first_round = [s for k, s in firsts if k == 0]
    steady = [s for k, s in firsts if k > 0] or first_round
    cpu = {f"{name}_cpu_pct": 100 * (cpu_s(pid) - cpu0[name]) / wall for name, pid in pids.items()}
    cpu["redis_cpu_pct"] = 100 * (redis_cpu_s(r) - redis0) / wall
    cpu["clients_cpu_pct"] = 100 * client_cpu / wall
    cpu.update({f"{name}_wait_for_cpu_pct": 100 * (cpu_wait_s(pid) - wait0[name]) / wall for name, pid in pids.items()})
    cpu["clients_wait_for_cpu_pct"] = 100 * client_wait / wall
    return {"clients": clients, "client_procs": procs, "streams": complete, "errors": len(errors),
            "error_kinds": sorted(set(errors))[:5], "first_token_p50_ms": pct(steady, 0.5),
            "first_token_p99_ms": pct(steady, 0.99), "first_round_p99_ms": pct(first_round, 0.99),
            "streams_per_s": complete / wall,
            **{k: round(v, 1) for k, v in cpu.items()},
            "gateway_cpu_ms_per_stream": round(10 * cpu["gateway_cpu_pct"] / max(complete / wall, 1e-9), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--sweep", default="8,16,32,64,128,256")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 4)),
                    help="processes the sweep's clients are spread over (default: the cores left after gateway, "
                         "worker and Redis, at most 8)")
    ap.add_argument("--sweep-tokens", type=int, default=16, help="max_tokens of each sweep stream")
    ap.add_argument("--sweep-step-ms", type=float, default=0.0,
                    help="0: the sweep runs on the instant fake engine; N: on a second worker whose fake engine takes "
                         "N ms a step (a decode pace), so streams stay open and deliver tokens over time")
    args = ap.parse_args()
    r = redis.Redis.from_url(args.redis_url)
    r.flushdb()
    logs = Path("/tmp") / f"gateway-bench-{os.getpid()}"
    logs.mkdir(exist_ok=True)
    port = 18000 + os.getpid() % 1000
    worker = start(["worker", "--redis-url", args.redis_url, "--model", "fake", "--served-model-name", MODEL,
                    "--max-num-seqs", "512", "--max-model-len", "4096", "--log-level", "WARNING"], logs / "worker.log")
    paced = None
    sweep_model = MODEL
    if args.sweep_step_ms > 0:
        sweep_model = f"fake-{args.sweep_step_ms:g}ms"
        paced = start(["worker", "--redis-url", args.redis_url, "--model", f"fake:{args.sweep_step_ms:g}", "--served-model-name",
                       sweep_model, "--max-num-seqs", "512", "--max-model-len", "4096", "--log-level", "WARNING"],
                      logs / "worker-paced.log")
    gateway = start(["gateway", "--redis-url", args.redis_url, "--port", str(port), "--log-level", "WARNING"], logs / "gateway.log")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/health")
        except RuntimeError:
            for name in ("gateway.log", "worker.log"):
                print(f"--- {name}:\n" + (logs / name).read_text()[-3000:], file=sys.stderr)
            raise
        with Producer.from_url(args.redis_url) as p:
            end = time.monotonic() + 60
            while not {MODEL, sweep_model} <= set(p.live_models()) and time.monotonic() < end:
                time.sleep(0.2)
            c = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
            for _ in range(20):  # warm-up (connections, JIT of nothing, caches)
                c.completions.create(model=MODEL, prompt="warm", max_tokens=2)
            out = {"machine": f"{platform.node()} {os.cpu_count()} cores, Python {platform.python_version()}",
                   "accelerators": accelerators(), "requests": args.requests, **sequential(p, c, args.requests)}
        sweep = []
        out["sweep_model"], out["sweep_tokens"] = sweep_model, args.sweep_tokens
        pids = {"gateway": gateway.pid, "worker": (paced or worker).pid}
        for n in (int(x) for x in args.sweep.split(",")):
            row = concurrent(f"http://127.0.0.1:{port}", sweep_model, args.sweep_tokens, n, args.rounds, args.client_procs, pids, r)
            sweep.append(row)
            print(json.dumps(row), flush=True)
        out["sweep"] = sweep
        ok = [row["clients"] for row in sweep if row["first_token_p99_ms"] < 100 and row["streams"] == row["clients"] * args.rounds]
        out["max_clients_p99_first_token_under_100ms"] = max(ok) if ok else 0
        # all of it again at the end, one line each, so the tail of the output holds the whole result
        print(json.dumps({k: v for k, v in out.items() if k != "sweep"}, indent=1))
        for row in sweep:
            print(json.dumps(row))
        print(json.dumps({"max_clients_p99_first_token_under_100ms": out["max_clients_p99_first_token_under_100ms"]}))
    finally:
        for proc in (gateway, worker, paced):
            if proc is None:
                continue
            proc.terminate()
            proc.wait(30)
        r.flushdb()


if __name__ == "__main__":
    main()
