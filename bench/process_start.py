"""What a test's process start costs: a worker (tiny Llama) until it logs `ready`, and a gateway until `/health`
answers, started fresh (`subprocess.Popen`) and forked from the tests' zygote (tests/zygote.py), alternately.

CPU is the started process's own utime + stime (/proc/PID/stat) at that moment; wall is from the call.
  usage (repo root):  .venv/bin/python bench/process_start.py [--rounds 3] [--redis-url redis://127.0.0.1:6379/12]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TRITON_INTERPRET", "1")  # as the suite runs on a machine without a GPU

import httpx  # noqa: E402
import zygote  # noqa: E402


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(how: str, kind: str, redis_url: str, model: str, log: Path) -> tuple[float, float]:
    if kind == "worker":
        cmd = [sys.executable, "-m", "pagestream.worker.cli", "worker", "--redis-url", redis_url, "--model", model,
               "--consumer", f"bench-{log.stem}", "--device", "cpu"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        port = None
    else:
        port = free_port()
        cmd = [sys.executable, "-m", "pagestream.worker.cli", "gateway", "--redis-url", redis_url, "--port", str(port)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    popen = subprocess.Popen if how == "fresh" else zygote.spawn
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} exited:\n{log.read_text()[-2000:]}")
            if kind == "worker" and "ready" in log.read_text():
                break
            if kind == "gateway":
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.02)
        return time.monotonic() - t0, cpu_s(proc.pid)
    finally:
        proc.kill()
        proc.wait(20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/12")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from pagestream.engine.smollm2 import ensure_smollm2
    from pagestream.engine.testing import write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="process-start-"))
    model = str(write_tiny_model(work / "tiny-llama", "llama", tokenizer_dir=ensure_smollm2()))
    zygote.start()
    t0 = time.monotonic()
    assert zygote._ensure(dict(os.environ)) is not None, "the zygote did not start"
    zygote_ready_s = time.monotonic() - t0
    zygote_cpu = cpu_s(zygote._state["zygotes"][0]["proc"].pid)
    runs: dict[str, list[tuple[float, float]]] = {}
    for i in range(args.rounds):
        for kind in ("worker", "gateway"):
            for how in ("fresh", "zygote"):
                runs.setdefault(f"{kind} {how}", []).append(start(how, kind, args.redis_url, model, work / f"{kind}-{how}-{i}.log"))
    summary = {"zygote_ready_s": round(zygote_ready_s, 2), "zygote_cpu_s": round(zygote_cpu, 2)}
    print(f"zygote: ready in {zygote_ready_s:.2f} s, {zygote_cpu:.2f} CPU s of imports (once per pytest process)")
    print(f"{'start':16} {'wall s (median)':>16} {'CPU s (median)':>15}  each run's CPU s")
    for name, xs in runs.items():
        wall, cpu = statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)
        summary[name] = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "cpu_runs": [round(x[1], 2) for x in xs]}
        print(f"{name:16} {wall:16.2f} {cpu:15.2f}  {', '.join(f'{x[1]:.2f}' for x in xs)}")
    zygote.stop()
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
