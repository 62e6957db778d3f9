"""What the queue costs: the worker loop driven by an instant fake engine, against Redis's own XADD floor.

    .venv/bin/python bench/queue_overhead.py [--redis-url redis://127.0.0.1:6379/15] [--jobs 2048] [--max-tokens 32] [--cluster]

Phases, all in one run on the same Redis:
  0. floor: ``redis-benchmark`` XADD (1 client, no pipelining and -P 64; 50 clients -P 16),
     and redis-py XADD one round trip at a time and pipelined by 64.
  1. throughput (worker in this process, fake engine, max_num_seqs=256): jobs/s, token
     events/s, and the loop time the queue adds per engine step while 256 jobs run
     (iteration time minus ``engine.step`` time).
  2. latency (worker as a separate ``pagestream worker --model fake`` process): submit at a
     steady rate, one subscriber; p50/p99 enqueue-to-first-token (the fake engine is
     instant, so this is all queue: XREADGROUP wake-up, admission, coalescing, XREAD).
With ``--cluster`` phases 1 and 2 run again, in the same run, on a 3-master Redis Cluster the
bench starts on free loopback ports (``tests/redis_cluster.py``, as the cluster tests do) and
stops at the end: the same worker and producer code on a sharded layout.
It FLUSHES the Redis db it is given: use a db nobody else uses.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]

import redis  # noqa: E402

sys.path.insert(0, str(ROOT))  # tests.redis_cluster: the same 3-master cluster the tests start

from pagestream.producer import Producer  # noqa: E402
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.redis_conn import connect  # noqa: E402
from tests.queue_helpers import lane_group  # noqa: E402


def redis_benchmark_floor(url: str, n: int) -> dict[str, float]:
    u = urlparse(url)
    db = (u.path or "/0").lstrip("/") or "0"
    out = {}
    stream = keys.bench_stream("floor")
    for label, args in {
        "c1_P1": ["-c", "1", "-P", "1"],
        "c1_P64": ["-c", "1", "-P", "64"],
        "c50_P16": ["-c", "50", "-P", "16"],
    }.items():
        cmd = ["redis-benchmark", "-h", u.hostname or "127.0.0.1", "-p", str(u.port or 6379), "--dbnum", db,
               "-n", str(n), "-q", *args, "XADD", stream, "*", "f", "v"]
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
        m = re.findall(r"([\d.]+) requests per second", text)
        out[label] = float(m[-1]) if m else float("nan")
        redis.Redis.from_url(url).delete(stream)
    return out


def redis_py_floor(url: str, n: int) -> dict[str, float]:
    r = redis.Redis.from_url(url)
    stream = keys.bench_stream("py")
    t = time.perf_counter()
    for _ in range(n // 10):
        r.xadd(stream, {"f": "v"})
    one = (n // 10) / (time.perf_counter() - t)
    t = time.perf_counter()
    for start in range(0, n, 64):
        pipe = r.pipeline(transaction=False)
        for _ in range(min(64, n - start)):
            pipe.xadd(stream, {"f": "v"})
        pipe.execute()
    piped = n / (time.perf_counter() - t)
    r.delete(stream)
    return {"one_at_a_time": one, "pipelined_64": piped}


def _flush(r) -> None:
    r.flushdb()  # redis-py sends it to every master of a cluster


def throughput(url: str, num_jobs: int, max_tokens: int, max_num_seqs: int, interval_ms: float) -> dict[str, float]:
    from pagestream.worker.fake_engine import FakeConfig, FakeEngine
    from pagestream.worker.settings import WorkerSettings
    from pagestream.worker.worker import Worker

    r = connect(url)
    _flush(r)
    p = Producer(r)
    for start in range(0, num_jobs, 512):
        p.submit_many([{"prompt": f"job {i}", "max_tokens": max_tokens, "seed": i} for i in range(start, min(num_jobs, start + 512))])
    settings = WorkerSettings(redis_url=url, consumer="bench", max_num_seqs=max_num_seqs, prefetch=max_num_seqs // 8,
                              publish_interval_ms=interval_ms, max_model_len=4096)
    engine = FakeEngine(FakeConfig(max_num_seqs=max_num_seqs, max_model_len=4096, num_blocks=1 << 20))
    w = Worker(r, engine, settings)

    step_times: list[float] = []
    iter_full: list[tuple[float, float]] = []  # (iteration s, step s) while >= 95% of max_num_seqs run
    real_step = engine.step

    def timed_step():
        t = time.perf_counter()
        out = real_step()
        step_times.append(time.perf_counter() - t)
        return out

    engine.step = timed_step
    real_iter = w._iteration

    def timed_iter(block):
        full = len(engine._running) >= 0.95 * max_num_seqs
        n_before = len(step_times)
        t = time.perf_counter()
        out = real_iter(block)
        dt = time.perf_counter() - t
        if full and len(step_times) > n_before:
            iter_full.append((dt, step_times[-1]))
        return out

    w._iteration = timed_iter
    t0 = time.perf_counter()
    w.run(burst=True)
    wall = time.perf_counter() - t0
    g = lane_group(r, "normal")  # summed over the lane's shards on a cluster
    assert g["entries-read"] == num_jobs and g["pending"] == 0, g
    overhead = [it - st for it, st in iter_full]
    res = {
        "jobs": num_jobs,
        "wall_s": wall,
        "jobs_per_s": num_jobs / wall,
        "tokens_per_s": num_jobs * max_tokens / wall,
        "events_written_per_s": w.publisher.num_events / wall,
        "tokens_per_event": num_jobs * max_tokens / max(1, w.publisher.num_events),
        "flushes": w.publisher.num_flushes,
        "steps": w.num_steps,
        "steps_at_full_batch": len(iter_full),
        "queue_ms_per_step_full_p50": 1000 * statistics.median(overhead) if overhead else float("nan"),
        "queue_ms_per_step_full_mean": 1000 * statistics.fmean(overhead) if overhead else float("nan"),
        "fake_engine_ms_per_step_full": 1000 * statistics.median([s for _, s in iter_full]) if iter_full else float("nan"),
    }
    _flush(r)
    return res


def latency(url: str, num_jobs: int, rate_per_s: float, max_num_seqs: int, interval_ms: float) -> dict[str, float]:
    r = connect(url)
    _flush(r)
    log_path = Path(tempfile.mkdtemp(prefix="ps-bench-")) / "worker.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagestream.worker.cli", "worker", "--redis-url", url, "--model", "fake", "--consumer", "bench-lat",
         "--max-num-seqs", str(max_num_seqs), "--publish-interval-ms", str(interval_ms), "--log-level", "WARNING"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 30
        while "ready" not in log_path.read_text() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        p = Producer(r)
        submitted: dict[str, float] = {}
        first: dict[str, float] = {}
        lock = threading.Lock()
        finished = threading.Event()

        def subscriber() -> None:
            sub = connect(url)
            while not finished.is_set():
                with lock:
                    waiting = {keys.out_stream(j): "0-0" for j in submitted if j not in first}
                if not waiting:
                    time.sleep(0.0005)
                    continue
                resp = _xread_any(sub, waiting)
                now = time.perf_counter()
                for stream, _ in resp or []:
                    jid = stream.decode().split("{", 1)[1].rstrip("}")
                    with lock:
                        first.setdefault(jid, now)

        th = threading.Thread(target=subscriber, daemon=True)
        th.start()
        gap = 1.0 / rate_per_s
        next_t = time.perf_counter()
        for i in range(num_jobs):
            while time.perf_counter() < next_t:
                time.sleep(0.0002)
            jid = f"lat-{i}"
            t = time.perf_counter()
            p.submit(prompt=f"latency {i}", max_tokens=4, job_id=jid)
            with lock:
                submitted[jid] = t
            next_t += gap
        end = time.time() + 30
        while len(first) < num_jobs and time.time() < end:
            time.sleep(0.01)
        finished.set()
        th.join(5)
        lat = sorted(1000 * (first[j] - submitted[j]) for j in first)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        _flush(r)
    q = statistics.quantiles(lat, n=100)
    return {"jobs": num_jobs, "seen": len(lat), "rate_per_s": rate_per_s, "p50_ms": q[49], "p99_ms": q[98], "max_ms": lat[-1]}


def _xread_any(client, waiting: dict[str, str]):
    """XREAD of many out streams: one blocking call on a single node; on a cluster (one slot per
    call) a pipeline of non-blocking reads, then a short pause when nothing came."""
    if not hasattr(client, "get_primaries"):
        return client.xread(waiting, count=1, block=2)
    pipe = client.pipeline(transaction=False)
    for stream, last in waiting.items():
        pipe.xread({stream: last}, count=1)
    resp = [row for res in pipe.execute() for row in res or []]
    if not resp:
        time.sleep(0.0005)
    return resp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15"))
    ap.add_argument("--jobs", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--interval-ms", type=float, default=20.0)
    ap.add_argument("--latency-jobs", type=int, default=400)
    ap.add_argument("--latency-rate", type=float, default=100.0)
    ap.add_argument("--floor-n", type=int, default=100_000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cluster", action="store_true", help="also run phases 1 and 2 on a 3-master Redis Cluster started here")
    a = ap.parse_args()

    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, redis-py {redis.__version__}, " \
              f"Redis {redis.Redis.from_url(a.redis_url).info('server')['redis_version']}"
    res = {
        "machine": machine,
        "redis_benchmark_xadd": redis_benchmark_floor(a.redis_url, a.floor_n),
        "redis_py_xadd": redis_py_floor(a.redis_url, a.floor_n // 2),
        "throughput": throughput(a.redis_url, a.jobs, a.max_tokens, a.max_num_seqs, a.interval_ms),
        "latency": latency(a.redis_url, a.latency_jobs, a.latency_rate, a.max_num_seqs, a.interval_ms),
    }
    if a.cluster:
        from tests.redis_cluster import RedisClusterProcs

        cluster = RedisClusterProcs(num_masters=3)
        try:
            layout = Producer.from_url(cluster.url).layout()
            res["cluster"] = {
                "masters": 3, "lane_shards": layout.num_shards,
                "throughput": throughput(cluster.url, a.jobs, a.max_tokens, a.max_num_seqs, a.interval_ms),
                "latency": latency(cluster.url, a.latency_jobs, a.latency_rate, a.max_num_seqs, a.interval_ms),
            }
        finally:
            cluster.stop()
    if a.json:
        print(json.dumps(res, indent=2))
        return
    fb, fp, t, lt = res["redis_benchmark_xadd"], res["redis_py_xadd"], res["throughput"], res["latency"]
    print(f"machine: {machine}")
    print(f"floor  redis-benchmark XADD: 1 client {fb['c1_P1']:,.0f}/s, 1 client -P 64 {fb['c1_P64']:,.0f}/s, 50 clients -P 16 {fb['c50_P16']:,.0f}/s")
    print(f"floor  redis-py XADD: one at a time {fp['one_at_a_time']:,.0f}/s, pipelined 64 {fp['pipelined_64']:,.0f}/s")
    print(f"worker {t['jobs']} jobs x {a.max_tokens} tokens, max_num_seqs {a.max_num_seqs}, publish interval {a.interval_ms} ms: "
          f"{t['wall_s']:.2f} s, {t['jobs_per_s']:,.0f} jobs/s, {t['tokens_per_s']:,.0f} tokens/s, "
          f"{t['events_written_per_s']:,.0f} events (XADD)/s at {t['tokens_per_event']:.1f} tokens/event")
    print(f"queue time per engine step at {a.max_num_seqs} running: p50 {t['queue_ms_per_step_full_p50']:.2f} ms, "
          f"mean {t['queue_ms_per_step_full_mean']:.2f} ms ({t['steps_at_full_batch']} of {t['steps']} steps; fake engine step "
          f"{t['fake_engine_ms_per_step_full']:.2f} ms)")
    print(f"enqueue -> first token ({lt['seen']}/{lt['jobs']} jobs at {lt['rate_per_s']:.0f}/s, worker process): "
          f"p50 {lt['p50_ms']:.1f} ms, p99 {lt['p99_ms']:.1f} ms, max {lt['max_ms']:.1f} ms")
    if a.cluster:
        c = res["cluster"]
        ct, cl = c["throughput"], c["latency"]
        print(f"CLUSTER ({c['masters']} masters, {c['lane_shards']} shards per lane), same worker and workload:")
        print(f"  worker: {ct['wall_s']:.2f} s, {ct['jobs_per_s']:,.0f} jobs/s, {ct['tokens_per_s']:,.0f} tokens/s, "
              f"{ct['events_written_per_s']:,.0f} events (XADD)/s at {ct['tokens_per_event']:.1f} tokens/event; "
              f"queue time per full step p50 {ct['queue_ms_per_step_full_p50']:.2f} ms, mean {ct['queue_ms_per_step_full_mean']:.2f} ms")
        print(f"  enqueue -> first token ({cl['seen']}/{cl['jobs']} jobs at {cl['rate_per_s']:.0f}/s): "
              f"p50 {cl['p50_ms']:.1f} ms, p99 {cl['p99_ms']:.1f} ms, max {cl['max_ms']:.1f} ms")


if __name__ == "__main__":
    main()
