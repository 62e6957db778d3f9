"""Memory under oversized lane entries (issue 8, acceptance 3): worker RSS and Redis memory.

    .venv/bin/python bench/hostile_memory.py [--entries 100] [--entry-mib 50] [--maxmemory 7gb]

Starts a private ``redis-server`` (no persistence, ``maxmemory`` so a shared machine is
never at risk) on a free loopback port, queues ``--entries`` raw XADDs of ``--entry-mib``
MiB each (a JSON job whose prompt is that big: a raw XADD bypasses the producer's
limits) with a few good jobs between them, then runs ``pagestream worker --model fake``
with its default settings (``max_entry_bytes`` 4 MiB, DLQ copies cut to 64 KiB) until
every job has a result. It samples the worker's RSS (and reads its peak, VmHWM) and
Redis's ``used_memory`` throughout, and reports the figures as JSON. The server and
everything queued go away at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.queue_helpers: the same private redis-server the tests use

from pagestream.producer import JobStatus, Producer  # noqa: E402
from pagestream.producer.protocol import keys  # noqa: E402
from pagestream.producer.protocol.job import JobField  # noqa: E402
from pagestream.producer.protocol.schema import JobResult  # noqa: E402
from tests.queue_helpers import start_redis_server  # noqa: E402

MiB = 1024 * 1024


def _proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=100)
    ap.add_argument("--entry-mib", type=int, default=50)
    ap.add_argument("--good-every", type=int, default=10, help="a good job after every N big entries")
    ap.add_argument("--maxmemory", default="7gb")
    ap.add_argument("--timeout-s", type=float, default=900)
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="ps-hostile-mem-"))
    server, url = start_redis_server(workdir, None, "--maxmemory", args.maxmemory, "--maxmemory-policy", "noeviction")
    r = redis.Redis.from_url(url)
    worker = None
    try:
        base_used = int(r.info("memory")["used_memory"])
        stream = keys.jobs_stream("normal")
        pad = b"x" * (args.entry_mib * MiB)
        big_ids, good_ids = [], []
        t0 = time.monotonic()
        with Producer.from_url(url) as p:
            for i in range(args.entries):
                jid = f"big-{i}"
                r.xadd(stream, {"job": b'{"job_id": "' + jid.encode() + b'", "prompt": "' + pad + b'"}'})
                big_ids.append(jid)
                if (i + 1) % args.good_every == 0:
                    good_ids.append(p.submit(prompt=f"neighbour {i}", max_tokens=8, seed=i))
        del pad
        queue_s = time.monotonic() - t0
        queued_used = int(r.info("memory")["used_memory"])

        log = open(workdir / "worker.log", "w")
        worker = subprocess.Popen(
            [sys.executable, "-m", "pagestream.worker.cli", "worker", "--redis-url", url, "--model", "fake",
             "--consumer", "bench", "--device", "cpu", "--log-level", "WARNING"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        samples: list[tuple[float, int, int]] = []  # (s, worker RSS KiB, redis used bytes)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set() and worker.poll() is None:
                try:
                    samples.append((time.monotonic() - t0, _proc_kib(worker.pid, "VmRSS"), int(r.info("memory")["used_memory"])))
                except (OSError, redis.RedisError):
                    pass
                stop.wait(0.1)

        t0 = time.monotonic()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        idle_rss = 0
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            if not idle_rss and "ready" in (workdir / "worker.log").read_text():
                idle_rss = _proc_kib(worker.pid, "VmRSS")
            done = sum(1 for j in big_ids + good_ids if r.hexists(keys.job_hash(j), JobField.RESULT))
            if done == len(big_ids) + len(good_ids) and r.xpending(stream, "workers")["pending"] == 0:
                break
            if worker.poll() is not None:
                raise SystemExit(f"worker exited:\n{(workdir / 'worker.log').read_text()[-3000:]}")
            time.sleep(0.5)
        process_s = time.monotonic() - t0
        peak_rss_kib = _proc_kib(worker.pid, "VmHWM")
        after_rss_kib = _proc_kib(worker.pid, "VmRSS")
        time.sleep(12)  # one trim interval (10 s): acked entries leave the lane
        stop.set()
        sampler.join(5)
        results = [JobResult.model_validate_json(r.hget(keys.job_hash(j), JobField.RESULT)) for j in big_ids + good_ids]
        big = results[: len(big_ids)]
        good = results[len(big_ids):]
        mem = r.info("memory")
        out = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                       f"Redis {r.info('server')['redis_version']} (private, no persistence, maxmemory {args.maxmemory})",
            "entries": args.entries,
            "entry_mib": args.entry_mib,
            "queue_seconds": round(queue_s, 1),
            "process_seconds": round(process_s, 1),
            "big_failed_with_reason": sum(1 for x in big if x.status == JobStatus.FAILED and "max_entry_bytes" in (x.error or "")),
            "good_completed": sum(1 for x in good if x.status == JobStatus.COMPLETED),
            "good_total": len(good),
            "worker_rss_idle_mib": round(idle_rss / 1024, 1),
            "worker_rss_peak_mib": round(peak_rss_kib / 1024, 1),
            "worker_rss_after_mib": round(after_rss_kib / 1024, 1),
            "redis_used_empty_mib": round(base_used / MiB, 1),
            "redis_used_queued_mib": round(queued_used / MiB, 1),
            "redis_used_peak_while_processing_mib": round(max(s[2] for s in samples) / MiB, 1) if samples else None,
            "redis_used_peak_ever_mib": round(int(mem["used_memory_peak"]) / MiB, 1),  # INFO's own peak (catches transients)
            "redis_used_after_trim_mib": round(int(mem["used_memory"]) / MiB, 1),
            "dlq_entries": r.xlen(keys.dead_letter_stream()),
            "dlq_bytes_mib": round((r.memory_usage(keys.dead_letter_stream()) or 0) / MiB, 2),
        }
        print(json.dumps(out, indent=2))
    finally:
        if worker is not None and worker.poll() is None:
            worker.terminate()
            worker.wait(30)
        server.kill()
        server.wait(10)


if __name__ == "__main__":
    main()
