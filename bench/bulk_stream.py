"""Bulk streaming benchmark: a large input through the orchestrator, its peak RSS and lines/s.

    .venv/bin/python bench/bulk_stream.py --lines 100000 --workers 2 --redis-url redis://127.0.0.1:6379/2

Runs, as separate processes: the RQ bulk worker (``pagestream bulk-worker --burst``,
the process whose RSS is measured, sampled from /proc every 0.1 s plus its VmHWM)
and N real ``pagestream worker --model fake`` processes (the instant fake engine,
so the queue, the sink and the orchestrator are what is measured). The Redis db
given is flushed first: point it at a db of your own. ``--s3`` writes the output
to a moto server over HTTP instead of a local directory.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_input(path: Path, n: int, bad_every: int) -> int:
    bad = 0
    with open(path, "w") as f:
        for i in range(1, n + 1):
            if bad_every and i % bad_every == 0:
                f.write("{this line is not json\n")
                bad += 1
            elif i % 2:
                f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "fake", "prompt": f"write a haiku about the number {i}",
                                             "max_tokens": 8, "temperature": 0}}) + "\n")
            else:
                f.write(json.dumps({"custom_id": f"r{i}", "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": f"what is {i} squared?"}], "max_tokens": 8}) + "\n")
    return bad


def rss_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in kB, or (0, 0) if the process is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0
    return int(fields.get("VmRSS", "0 kB").split()[0]), int(fields.get("VmHWM", "0 kB").split()[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/2")
    ap.add_argument("--bad-every", type=int, default=1000, help="every n-th line is malformed (0: none)")
    ap.add_argument("--max-outstanding", type=int, default=4096)
    ap.add_argument("--shard-lines", type=int, default=50_000)
    ap.add_argument("--flush-lines", type=int, default=512)
    ap.add_argument("--s3", action="store_true", help="output to a moto server over HTTP")
    ap.add_argument("--timeout-s", type=float, default=1800)
    args = ap.parse_args()

    import redis

    from pagestream.producer.bulk.api import get_bulk, submit_bulk

    r = redis.Redis.from_url(args.redis_url, decode_responses=True)
    r.flushdb()
    tmp = Path(tempfile.mkdtemp(prefix="bulk-bench-"))
    inp = tmp / "in.jsonl"
    n_bad = write_input(inp, args.lines, args.bad_every)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), "PAGESTREAM_BULK_FLUSH_LINES": str(args.flush_lines),
           "PAGESTREAM_BULK_FLUSH_INTERVAL_S": "1"}
    procs: list[subprocess.Popen] = []
    moto = None
    if args.s3:
        sys.path.insert(0, str(ROOT / "tests"))
        import boto3
        from test_bulk_support import AWS_ENV, start_moto

        os.environ.update(AWS_ENV)
        moto, url = start_moto()
        env.update(AWS_ENV, S3_ENDPOINT_URL=url)
        os.environ["S3_ENDPOINT_URL"] = url
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket="bench")
        out = "s3://bench/out"
    else:
        out = str(tmp / "out")
    exe = str(Path(sys.executable).with_name("pagestream"))
    try:
        for i in range(args.workers):
            procs.append(subprocess.Popen([exe, "worker", "--redis-url", args.redis_url, "--model", "fake",
                                           "--lanes", "low", "--max-num-seqs", "64", "--consumer", f"bench-w{i}",
                                           "--log-level", "WARNING"], env=env, stdout=subprocess.DEVNULL))
        t0 = time.time()
        bulk_id = submit_bulk(str(inp), out, redis_url=args.redis_url, max_outstanding=args.max_outstanding,
                              shard_lines=args.shard_lines)
        orch = subprocess.Popen([exe, "bulk-worker", "--redis-url", args.redis_url, "--burst"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(orch)
        peak_rss = hwm = 0
        while orch.poll() is None and time.time() - t0 < args.timeout_s:
            rss, h = rss_kb(orch.pid)
            peak_rss, hwm = max(peak_rss, rss), max(hwm, h)
            time.sleep(0.1)
        wall = time.time() - t0
        st = get_bulk(r, bulk_id)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        if moto is not None:
            moto.terminate()
    counts = st["request_counts"]
    result = {
        "lines": args.lines,
        "status": st["status"],
        "request_counts": counts,
        "expected_failed": n_bad,
        "wall_s": round(wall, 2),
        "lines_per_s": round(args.lines / wall, 1),
        "orchestrator_peak_rss_mb": round(max(peak_rss, hwm) / 1024, 1),
        "workers": args.workers,
        "output": "s3 (moto server, HTTP)" if args.s3 else "local dir",
        "machine": f"{platform.machine()} {os.cpu_count()} cpu, {platform.platform()}",
    }
    print(json.dumps(result, indent=2))
    ok = st["status"] == "completed" and counts == {"total": args.lines, "completed": args.lines - n_bad,
                                                    "failed": n_bad}
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
