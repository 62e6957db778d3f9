"""What the gateway costs per request, on the CPU: a guard to run before a change to the request path lands.

    nice -n 19 /work/main/.venv/bin/python bench/gateway_cost.py [--tree PATH] [--against PATH] [--pairs 1]
        [--requests 200] [--tokens 64] [--concurrency 16] [--step-ms 5] [--client-procs 1] [--out DIR]
        [--redis-url URL]

e.g. HEAD against 798cfba:  git archive 798cfba | tar -x -C /tmp/before798 &&
     nice -n 19 /work/main/.venv/bin/python bench/gateway_cost.py --against /tmp/before798 --out /tmp

Per run, for one tree: a redis-server of its own on a free port (``--redis-url``: an existing db
instead, which it FLUSHES; INFO commandstats is then the whole server's, other users' commands
counted in), one ``pagestream worker --model fake:STEP_MS`` (the fake engine: a step takes
``--step-ms``, so tokens reach the gateway over time in several events, as a GPU's decode steps
do) and one ``pagestream gateway``, both started from the tree (``--tree``, default: the checkout
this file is in) as bench/tree_pair.py says. After a warm-up, measured apart:
  idle        2 s with no request: the gateway's CPU and Redis commands per second in the background
  stream      ``--requests`` streaming ``/v1/completions`` (token-id prompt, ``max_tokens`` =
              ``min_tokens`` = ``--tokens``, ignore_eos), ``--concurrency`` open at a time, raw httpx
              SSE clients in ``--client-procs`` processes; every stream checked: [DONE], no error
              event, exactly ``--tokens`` tokens (the fake's text is one ``<id>`` per token)
  nonstream   the same requests without streaming (usage.completion_tokens checked)
For each phase: the gateway process's CPU seconds (utime + stime from /proc/PID/stat, every
thread) per request, and for ``stream`` per streamed token and per SSE event; Redis commands per
request (INFO commandstats delta: the total and the top commands) and, on the private server, by
process (MONITOR, each command's client port matched to the gateway's or the worker's sockets in
/proc: ``gateway_redis_commands_per_request`` and its top commands); the worker's and Redis's CPU
per request beside them (MONITOR adds to Redis's); wall time. ``--against PATH`` runs a second tree the same way, alternately
(tree, against, tree, against, ... ``--pairs`` of each), and the table gives against / tree. One
JSON with every run: ``OUT/gateway_cost.json``.
Measure on a quiet machine, or at least the same load for both trees (the pairs alternate for that).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_pair import (ROOT, RedisServer, cpu_s, describe, wait_model_listed, free_port, import_root, median, product,  # noqa: E402
                       schedule, scratch_dir, stop)

MODEL = "fake"
#: the prompt every request sends (token ids: no tokenizer work at the gateway or the worker)
PROMPT = list(range(100, 164))


def commandstats(r: redis.Redis) -> dict[str, int]:
    """Calls per command so far (INFO commandstats; ``cmdstat_xadd`` -> ``xadd``)."""
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}


def redis_cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def socket_ports(pid: int, server_port: int) -> set[int]:
    """The local ports of ``pid``'s TCP connections to 127.0.0.1:``server_port`` (Linux /proc: the process's
    socket inodes matched against /proc/net/tcp)."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[9] in inodes and int(f[2].rsplit(":", 1)[1], 16) == server_port:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


class CommandLog:
    """MONITOR on the Redis server while a phase runs: every command a client sent (a Lua script's own
    calls apart), so each process's commands are counted by its connections' ports."""

    STOP = "gateway-cost-monitor-stop"

    def __init__(self, r: redis.Redis) -> None:
        import threading

        self.r = r
        self.seen: list[tuple[str, str]] = []  # (client port, command name)
        self.lua = 0
        self.monitor = r.monitor()
        self.monitor.__enter__()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for ev in self.monitor.listen():
            cmd = ev["command"]
            if ev["client_type"] == "lua":
                self.lua += 1
                continue
            if cmd == f"ECHO {self.STOP}":
                return
            self.seen.append((ev["client_port"], cmd.split(" ", 1)[0].lower()))

    def close(self) -> None:
        self.r.echo(self.STOP)
        self.thread.join(30)
        self.monitor.__exit__()


class Meter:
    """CPU of the gateway, the worker and Redis, and Redis's commands (in all, and by process through
    MONITOR), between ``start()`` and ``stop()``."""

    def __init__(self, r: redis.Redis, pids: dict[str, int], by_process: bool = True) -> None:
        self.r, self.pids, self.by_process = r, pids, by_process
        self.server_port = int(r.connection_pool.connection_kwargs.get("port", 6379))

    def start(self) -> None:
        self.log = CommandLog(self.r) if self.by_process else None
        self.cpu0 = {name: cpu_s(pid) for name, pid in self.pids.items()}
        self.redis0 = redis_cpu_s(self.r)
        self.cmds0 = commandstats(self.r)
        self.t0 = time.perf_counter()

    def stop(self, n: int) -> dict:
        wall = time.perf_counter() - self.t0
        cpu1 = {name: cpu_s(pid) for name, pid in self.pids.items()}
        redis1 = redis_cpu_s(self.r)
        cmds1 = commandstats(self.r)
        out = {"requests": n, "wall_s": round(wall, 3)}
        for name in self.pids:
            used = cpu1[name] - self.cpu0[name]
            out[f"{name}_cpu_s"] = round(used, 4)
            out[f"{name}_cpu_ms_per_request"] = round(1e3 * used / n, 3)
        out["redis_cpu_s"] = round(redis1 - self.redis0, 4)
        out["redis_cpu_ms_per_request"] = round(1e3 * (redis1 - self.redis0) / n, 3)
        # the meter's own INFO and MONITOR calls are not the product's
        own = {"info": 2, "monitor": 1, "echo": 1} if self.log else {"info": 2}
        delta = {k: v - self.cmds0.get(k, 0) - own.get(k, 0) for k, v in cmds1.items()}
        delta = {k: v for k, v in delta.items() if v > 0}
        total = sum(delta.values())
        out["redis_commands"] = total
        out["redis_commands_per_request"] = round(total / n, 2)
        top = sorted(delta.items(), key=lambda kv: -kv[1])[:12]
        out["redis_top_commands_per_request"] = {k: round(v / n, 2) for k, v in top}
        if self.log:
            self.log.close()
            owner = {str(port): name for name, pid in self.pids.items() for port in socket_ports(pid, self.server_port)}
            mine = {str(port) for port in socket_ports(os.getpid(), self.server_port)}  # the meter's INFO, ECHO
            by: dict[str, dict[str, int]] = {}
            for port, cmd in self.log.seen:
                if port in mine:
                    continue
                name = owner.get(port, "other")
                by.setdefault(name, {})
                by[name][cmd] = by[name].get(cmd, 0) + 1
            for name, cmds in sorted(by.items()):
                out[f"{name}_redis_commands_per_request"] = round(sum(cmds.values()) / n, 2)
                top = sorted(cmds.items(), key=lambda kv: -kv[1])[:10]
                out[f"{name}_redis_top_commands_per_request"] = {k: round(v / n, 2) for k, v in top}
            out["lua_inner_calls_per_request"] = round(self.log.lua / n, 2)
        return out


# ---- the load (runs in client processes) ---------------------------------------------------------------

async def _one(http: httpx.AsyncClient, stream: bool, tokens: int, seed: int) -> tuple[str | None, int, int]:
    """One completion: (what went wrong or None, tokens received, SSE events with text)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "seed": seed, "stream": stream}
    if not stream:
        resp = await http.post("/v1/completions", json=body)
        if resp.status_code != 200:
            return f"HTTP {resp.status_code}", 0, 0
        got = resp.json()["usage"]["completion_tokens"]
        return (None if got == tokens else "wrong token count"), got, 0
    got = events = 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return f"HTTP {resp.status_code}", 0, 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return (None if got == tokens else "wrong token count"), got, events
            ch = json.loads(data)
            if "error" in ch:
                return f"error event {ch['error'].get('code')}", got, events
            text = ch["choices"][0]["text"] if ch.get("choices") else ""
            if text:
                events += 1
                got += text.count("<")
    return "no [DONE]", got, events


async def _clients(base_url: str, stream: bool, tokens: int, ids: list[int], concurrency: int, conn) -> tuple:
    errors: list[str] = []
    got = events = 0
    todo = list(ids)
    https = [httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=1))
             for _ in range(concurrency)]

    async def lane(http: httpx.AsyncClient) -> None:
        nonlocal got, events
        while todo:
            i = todo.pop()
            try:
                err, n, e = await _one(http, stream, tokens, i)
            except httpx.HTTPError as exc:
                err, n, e = type(exc).__name__, 0, 0
            got += n
            events += e
            if err is not None:
                errors.append(err)

    conn.send("ready")
    conn.recv()
    await asyncio.gather(*(lane(h) for h in https))
    end = time.perf_counter()
    for h in https:
        await h.aclose()
    return errors, got, events, end


def _client_proc(base_url, stream, tokens, ids, concurrency, conn) -> None:
    conn.send(asyncio.run(_clients(base_url, stream, tokens, ids, concurrency, conn)))
    conn.close()


def load(base_url: str, stream: bool, tokens: int, n: int, concurrency: int, procs: int, meter: Meter) -> dict:
    """``n`` requests, ``concurrency`` at a time over ``procs`` client processes, metered from the go."""
    ctx = mp.get_context("spawn")
    procs = max(1, min(procs, concurrency))
    children = []
    for k in range(procs):
        parent, child = ctx.Pipe()
        per = concurrency // procs + (1 if k < concurrency % procs else 0)
        proc = ctx.Process(target=_client_proc, args=(base_url, stream, tokens, list(range(k, n, procs)), per, child),
                           daemon=True)
        proc.start()
        children.append((proc, parent))
    for _, parent in children:
        assert parent.recv() == "ready"
    meter.start()
    t0 = time.perf_counter()
    for _, parent in children:
        parent.send("go")
    errors, got, events, end = [], 0, 0, t0
    for proc, parent in children:
        e, g, ev, proc_end = parent.recv()
        errors += e
        got += g
        events += ev
        end = max(end, proc_end)
        proc.join(30)
    out = meter.stop(n)
    out["load_wall_s"] = round(end - t0, 3)
    out["errors"] = len(errors)
    out["error_kinds"] = sorted(set(errors))[:5]
    out["tokens"] = got
    if stream:
        out["sse_events"] = events
        out["events_per_stream"] = round(events / n, 2)
        out["gateway_cpu_us_per_token"] = round(1e6 * out["gateway_cpu_s"] / got, 2) if got else None
        out["gateway_cpu_us_per_event"] = round(1e6 * out["gateway_cpu_s"] / events, 2) if events else None
    return out


def run_tree(label: str, tree: str, args, scratch: Path) -> dict:
    logs = scratch / f"logs-{label}-{int(time.time() * 1000)}"
    logs.mkdir()
    root = import_root(tree, scratch)
    server = RedisServer(logs) if not args.redis_url else None
    url = server.url if server else args.redis_url
    r = redis.Redis.from_url(url)
    r.flushdb()
    port = free_port()
    worker = gateway = None
    try:
        worker = product(root, ["worker", "--redis-url", url, "--model", f"fake:{args.step_ms:g}", "--served-model-name",
                                MODEL, "--max-num-seqs", "512", "--max-model-len", "4096", "--log-level", "WARNING"],
                         logs / "worker.log", cwd=scratch)
        gateway = product(root, ["gateway", "--redis-url", url, "--port", str(port), "--log-level", "WARNING"],
                          logs / "gateway.log", cwd=scratch)
        base = f"http://127.0.0.1:{port}"
        wait_model_listed(base, MODEL, {"worker": worker, "gateway": gateway}, logs, timeout=120)
        # MONITOR only on a server of our own (on a shared one it would slow everyone's commands)
        meter = Meter(r, {"gateway": gateway.pid, "worker": worker.pid}, by_process=server is not None)
        warm = load(base, True, args.tokens, 2 * args.concurrency, args.concurrency, 1, meter)
        load(base, False, args.tokens, 2 * args.concurrency, args.concurrency, 1, meter)
        meter.start()
        time.sleep(2.0)
        idle = meter.stop(1)
        idle = {"wall_s": idle["wall_s"], "gateway_cpu_ms_per_s": round(1e3 * idle["gateway_cpu_s"] / idle["wall_s"], 3),
                "redis_commands_per_s": round(idle["redis_commands"] / idle["wall_s"], 1),
                "redis_top_commands": idle["redis_top_commands_per_request"]}
        out = {"label": label, "tree": str(Path(tree).resolve()), "commit": describe(tree), "idle": idle,
               "warmup_errors": warm["errors"]}
        for phase, stream in (("stream", True), ("nonstream", False)):
            spy = None
            if args.py_spy:  # the gateway's stacks during this phase, as py-spy's collapsed ("raw") format
                spy = subprocess.Popen([args.py_spy_bin, "record", "--pid", str(gateway.pid), "--format", "raw",
                                        "--rate", "250", "--nonblocking", "-o",
                                        str(Path(args.py_spy) / f"{label}-{phase}-{int(time.time())}.txt")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)  # attached before the load starts
            out[phase] = load(base, stream, args.tokens, args.requests, args.concurrency, args.client_procs, meter)
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
        return out
    finally:
        stop(gateway, 30)
        stop(worker, 30)
        r.flushdb()
        if server:
            server.close()


#: the figures the table compares (phase, key)
HEADLINE = [("stream", "gateway_cpu_ms_per_request"), ("stream", "gateway_cpu_us_per_token"),
            ("stream", "gateway_cpu_us_per_event"), ("stream", "events_per_stream"),
            ("stream", "redis_commands_per_request"), ("stream", "gateway_redis_commands_per_request"),
            ("stream", "worker_redis_commands_per_request"), ("stream", "worker_cpu_ms_per_request"), ("stream", "wall_s"),
            ("nonstream", "gateway_cpu_ms_per_request"), ("nonstream", "redis_commands_per_request"),
            ("nonstream", "gateway_redis_commands_per_request"), ("nonstream", "worker_redis_commands_per_request"),
            ("nonstream", "worker_cpu_ms_per_request"), ("nonstream", "wall_s"), ("idle", "gateway_cpu_ms_per_s"),
            ("idle", "redis_commands_per_s")]


def summarize(runs: list[dict]) -> dict:
    labels = list(dict.fromkeys(r["label"] for r in runs))
    summary: dict = {}
    for label in labels:
        mine = [r for r in runs if r["label"] == label]
        summary[label] = {f"{phase}.{key}": median([r[phase].get(key) for r in mine
                                                     if isinstance(r[phase].get(key), (int, float))])
                          for phase, key in HEADLINE}
    if len(labels) == 2:
        a, b = (summary[x] for x in labels)
        summary["against_over_tree"] = {k: (round(b[k] / a[k], 3) if a[k] else None) for k in a}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default=str(ROOT), help="the source tree to measure (default: this checkout)")
    ap.add_argument("--against", default=None, help="a second tree, run alternately with --tree")
    ap.add_argument("--pairs", type=int, default=1, help="runs of each tree (alternating)")
    ap.add_argument("--requests", type=int, default=200, help="requests per phase")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each request makes")
    ap.add_argument("--concurrency", type=int, default=16, help="requests open at a time")
    ap.add_argument("--step-ms", type=float, default=5.0, help="the fake engine's step time (0: instant)")
    ap.add_argument("--client-procs", type=int, default=1, help="processes the clients are spread over")
    ap.add_argument("--redis-url", default=None, help="use this Redis db (FLUSHED) instead of a private redis-server")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--py-spy", default=None, metavar="DIR",
                    help="record the gateway's stacks per phase with py-spy (collapsed format) into DIR")
    ap.add_argument("--py-spy-bin", default=str(Path(sys.executable).with_name("py-spy")), help="the py-spy executable")
    args = ap.parse_args()
    scratch = scratch_dir("gateway-cost-")
    res = {"argv": sys.argv, "machine": f"{platform.node()} {os.cpu_count()} cores, Python {platform.python_version()}",
           "load_avg_at_start": os.getloadavg(), "runs": []}
    path = Path(args.out) / "gateway_cost.json"
    for label, tree in schedule(args.tree, args.against, args.pairs):
        run = run_tree(label, tree, args, scratch)
        res["runs"].append(run)
        print(json.dumps({k: run[k] for k in ("label", "commit", "stream", "nonstream")}), flush=True)
        res["summary"] = summarize(res["runs"])
        path.write_text(json.dumps(res, indent=1))
    res["load_avg_at_end"] = os.getloadavg()
    path.write_text(json.dumps(res, indent=1))
    s = res["summary"]
    labels = [x for x in s if x != "against_over_tree"]
    print(f"\n{'figure (median of runs)':48}" + "".join(f"{x:>14}" for x in labels)
          + (f"{'against/tree':>14}" if "against_over_tree" in s else ""))
    for k in s[labels[0]]:
        row = f"{k:48}" + "".join(f"{s[x][k]:>14.4g}" for x in labels)
        if "against_over_tree" in s:
            v = s["against_over_tree"][k]
            row += f"{v:>14.3f}" if v is not None else f"{'-':>14}"
        print(row)
    print("\ntrees: " + ", ".join(f"{r['label']}={r['commit']}" for r in res["runs"][:len(labels)]) + f"; JSON: {path}")


if __name__ == "__main__":
    main()
