"""Where the 1B decode and prefill steps lose time against their floors, on the H200, in one call.

    . bench/device_env.sh && python3 bench/decode_probe.py --out $OUT [--skip tail,first_use,...]

Sections (each reported in decode_probe.json; one failing does not stop the others):
- tail: the last steps of a batch, where samples finish 32 at a time (per step, per phase).
- first_use: what the first decode step at a new batch size pays (the LM head's matmul at a new row
  count, a graph's first replay).
- engine: kernel time by name over the prefill steps of the 1b-fixed workload (256 x 512 tokens) and over
  decode steps of 256 sequences at ~600-token contexts (torch profiler; graphs replayed as the engine does);
  then the paged decode kernel on the engine's own block tables and context lengths (taken from the
  runner's graph buffers) and on synthetic tables, for tile, warp, stage, split and program-order variants:
  16 calls (one per layer's cache) captured in a CUDA graph, TB/s of K/V read.
- prefill_attention: one 1B prefill step's attention (32 x 512 tokens, head_dim 64) per tile config, beside
  flash SDPA.
- small_m: a split-K Triton matmul against cuBLAS at M=256 for each projection.
- argmax: torch's argmax against kernels.argmax over [256, 128256] bf16 logits.
- matmul: each projection at M=256 and M=16384, cuBLAS against cuBLASLt, beside the measured bf16 rate F.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_engine import ceilings  # noqa: E402
from phase_timers import timed_methods  # noqa: E402
from throughput import SHAPES, model_dir_for  # noqa: E402


@triton.jit
def _mm(a_ptr, w_ptr, c_ptr, M, N, K_SPLIT, stride_am, stride_wn, stride_cs, stride_cm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    c_ptrs = c_ptr + pid_k * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=offs_m[:, None] < M)
    else:
        tl.store(c_ptrs, acc, mask=offs_m[:, None] < M)

@triton.jit
def _sum_splits(p_ptr, c_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)

def log(*a):
    print(*a, flush=True)


def kernel_times(prof, n_steps: int) -> dict[str, float]:
    by: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name[:80]] = by.get(e.name[:80], 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    total = sum(by.values())
    top = dict(sorted(((k, v / n_steps) for k, v in by.items()), key=lambda kv: -kv[1])[:20])
    return {"kernel_ms_per_step_total": total / n_steps, "top_ms_per_step": top}


def graph_time_ms(fn, reps: int = 20) -> float:
    """Median ms of one replay of a graph holding fn()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def engine_section(args, res):
    from torch.profiler import ProfilerActivity, profile as tprofile

    from pagestream.engine import LLM, SamplingParams

    device = torch.device("cuda")
    model_dir = model_dir_for("llama-3.2-1b", device)
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.85, max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=16384)
    engine = llm.llm_engine
    vocab = SHAPES["llama-3.2-1b"]["vocab_size"]
    rng = random.Random(6)
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(256):
        engine.add_request(f"p{i}", prompt_token_ids=[rng.randrange(3, vocab) for _ in range(512)], params=sp)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        n = 0
        while len(engine.scheduler.running) < 256 or engine.scheduler.waiting:
            engine.step()
            n += 1
        engine.step()
        n += 1
        torch.cuda.synchronize()
    res["prefill_phase"] = {"steps": n, "wall_s_profiled": time.perf_counter() - t0, **kernel_times(prof, 1)}
    log("prefill", json.dumps(res["prefill_phase"], indent=1))
    for _ in range(80):
        engine.step()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(16):
            engine.step()
        torch.cuda.synchronize()
    res["decode_step"] = kernel_times(prof, 16)
    log("decode", json.dumps(res["decode_step"], indent=1))
    runner = engine.runner
    bt = runner.g_block_tables[:256].clone()
    ctx = runner.g_context_lens[:256].clone()
    caches = [(a.k_cache, a.v_cache) for a in runner.model.attention_layers()]
    return llm, bt, ctx, caches


def attention_section(args, res, bt, ctx, caches, bw):
    from pagestream.kernels.paged_decode_attention import paged_decode_attention

    n = bt.shape[0]
    q = torch.randn(n, 32, 64, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    nbytes = int(ctx.sum()) * 8 * 64 * 2 * 2 * len(caches)
    res["attn_ctx"] = {"min": int(ctx.min()), "max": int(ctx.max()), "mean": float(ctx.float().mean()),
                       "bt_width": bt.shape[1], "gb_per_16_layers": nbytes / 1e9}
    num_blocks = caches[0][0].shape[0]
    nb = bt.shape[1]
    used = int((ctx.max() + 15) // 16)
    contiguous = torch.zeros_like(bt)
    contiguous[:, :used] = (torch.arange(n * used, device="cuda", dtype=torch.int32) % num_blocks).view(n, used)
    perm = torch.randperm(num_blocks, device="cuda")[: n * used].to(torch.int32)
    randomised = torch.zeros_like(bt)
    randomised[:, :used] = perm.view(n, used)
    ref = paged_decode_attention(q, caches[0][0], caches[0][1], bt, ctx, 0.125)
    variants = [dict()]
    for bn in (32, 64, 128):
        for w in (2, 4, 8):
            for st in (2, 3, 4):
                if (bn, w, st) != (64, 4, 2):
                    variants.append(dict(block_n=bn, num_warps=w, num_stages=st))
    variants += [dict(num_splits=2), dict(num_splits=4), dict(heads_first=True),
                 dict(heads_first=True, num_stages=3), dict(heads_first=True, num_warps=2),
                 dict(heads_first=True, block_n=32), dict(heads_first=True, num_splits=2)]
    rows = []
    for tables_name, tables in (("engine", bt), ("contiguous", contiguous), ("random", randomised)):
        for kw in variants if tables_name == "engine" else [dict(), dict(heads_first=True)]:
            try:
                got = paged_decode_attention(q, caches[0][0], caches[0][1], bt if tables_name == "engine" else tables,
                                             ctx, 0.125, **kw)
                err = float((got.float() - ref.float()).abs().max()) if tables_name == "engine" else None

                def fn(kw=kw, tables=tables):
                    for kc, vc in caches:
                        paged_decode_attention(q, kc, vc, tables, ctx, 0.125, out=out, **kw)

                ms = graph_time_ms(fn)
                row = {"tables": tables_name, **kw, "us_per_layer": 1e3 * ms / len(caches),
                       "tb_s": nbytes / (ms * 1e-3) / 1e12, "of_copy_rate": nbytes / (ms * 1e-3) / bw,
                       "max_abs_err_vs_default": err}
            except Exception as exc:  # noqa: BLE001
                row = {"tables": tables_name, **kw, "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            log(json.dumps(row))
    res["attention"] = rows


def matmul_section(res, flops):
    rows = []
    shapes = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048),
              "lm_head": (2048, 128256)}
    for lib in ("cublas", "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(lib)
        except Exception as exc:  # noqa: BLE001
            rows.append({"lib": lib, "error": str(exc)[:200]})
            continue
        for m in (256, 16384):
            for name, (k, nn) in shapes.items():
                if name == "lm_head" and m > 256:
                    continue
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                w = torch.randn(nn, k, dtype=torch.bfloat16, device="cuda") * 0.02
                reps = 16

                def fn(x=x, w=w):
                    for _ in range(reps):
                        torch.nn.functional.linear(x, w)

                ms = graph_time_ms(fn) / reps
                fl = 2 * m * k * nn
                wbytes = 2 * k * nn
                row = {"lib": lib, "m": m, "proj": name, "us": 1e3 * ms, "tflops": fl / (ms * 1e-3) / 1e12,
                       "of_F": fl / (ms * 1e-3) / flops, "floor_us": 1e6 * max(fl / flops, wbytes / 4.2e12)}
                rows.append(row)
                log(json.dumps(row))
    torch.backends.cuda.preferred_blas_library("cublas")
    res["matmul"] = rows


def prefill_attention_section(res):
    """The 1B prefill step's attention (32 prompts x 512 tokens, head_dim 64) per tile config, beside flash SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gpu_kernels import causal_flops, prefill_inputs
    from pagestream.kernels.paged_prefill_attention import paged_prefill_attention

    batch, seqlen = 32, 512
    q, k, v, kc, vc, bt, cu, ctx = prefill_inputs(batch, seqlen, head_dim=64)
    flops = causal_flops(batch, seqlen, seqlen, head_dim=64)
    qs = q.view(batch, seqlen, 32, 64).transpose(1, 2).contiguous()
    ks = k.repeat_interleave(4, dim=2).transpose(1, 2).contiguous()
    vs = v.repeat_interleave(4, dim=2).transpose(1, 2).contiguous()
    rows = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = graph_time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
    rows.append({"kernel": "flash_sdpa", "us": 1e3 * ms, "tflops": flops / (ms * 1e-3) / 1e12})
    log(json.dumps(rows[-1]))
    ref = paged_prefill_attention(q, kc, vc, bt, cu, ctx, 0.125)
    configs = [{}]
    for bm in (64, 128, 256):
        for bn in (32, 64, 128):
            for w in (4, 8):
                for st in (2, 3, 4):
                    if bm == 256 and w == 4:
                        continue
                    configs.append(dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st))
    for kw in configs:
        try:
            got = paged_prefill_attention(q, kc, vc, bt, cu, ctx, 0.125, **kw)
            err = float((got.float() - ref.float()).abs().max())
            ms = graph_time_ms(lambda kw=kw: paged_prefill_attention(q, kc, vc, bt, cu, ctx, 0.125, **kw))
            row = {"kernel": "paged_prefill", **kw, "us": 1e3 * ms, "tflops": flops / (ms * 1e-3) / 1e12,
                   "max_abs_err_vs_default": err}
        except Exception as exc:  # noqa: BLE001
            row = {"kernel": "paged_prefill", **kw, "error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        log(json.dumps(row))
    res["prefill_attention"] = rows


def small_m_section(res, flops):
    """Split-K Triton matmul against cuBLAS at M=256 for the projections cuBLAS runs below F."""
    def mm(x, w, bm, bn, bk, split, warps, stages):
        m, k = x.shape
        n = w.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(m, bm), n // bn, split)
        if split == 1:
            _mm[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), 0, out.stride(0),
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=warps, num_stages=stages)
            return out
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        _mm[grid](x, w, part, m, n, k // split, x.stride(0), w.stride(0), part.stride(0), part.stride(1),
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)
        _sum_splits[(triton.cdiv(m * n, 1024),)](part, out, m * n, SPLIT_K=split, BLOCK=1024, num_warps=4)
        return out

    rows = []
    shapes = {"qkv": (2048, 3072), "o": (2048, 2048), "down": (8192, 2048), "gate_up": (2048, 16384)}
    for name, (k, n) in shapes.items():
        x = torch.randn(256, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        ref = torch.nn.functional.linear(x, w)
        reps = 16
        ms = graph_time_ms(lambda: [torch.nn.functional.linear(x, w) for _ in range(reps)]) / reps
        fl = 2 * 256 * k * n
        rows.append({"proj": name, "impl": "cublas", "us": 1e3 * ms, "of_F": fl / (ms * 1e-3) / flops})
        log(json.dumps(rows[-1]))
        try:
            xs = x.view(256, 4, k // 4).transpose(0, 1)
            ws = w.view(n, 4, k // 4).transpose(0, 1).transpose(1, 2)
            fn = lambda: torch.bmm(xs, ws, out_dtype=torch.float32).sum(0).to(torch.bfloat16)  # noqa: E731
            err = float((fn().float() - ref.float()).abs().max())
            ms = graph_time_ms(lambda: [fn() for _ in range(reps)]) / reps
            rows.append({"proj": name, "impl": "bmm_splitk4_fp32", "us": 1e3 * ms, "of_F": fl / (ms * 1e-3) / flops,
                         "max_abs_err": err})
        except Exception as exc:  # noqa: BLE001
            rows.append({"proj": name, "impl": "bmm_splitk4_fp32", "error": str(exc)[:200]})
        log(json.dumps(rows[-1]))
        for bm, bn in ((64, 128), (128, 64), (128, 128), (64, 256)):
            for bk in (64, 128):
                for split in (1, 2, 4, 8):
                    if k // split < 2 * bk or (name == "gate_up" and split > 2):
                        continue
                    for warps, stages in ((4, 4), (8, 3), (4, 3)):
                        kw = dict(bm=bm, bn=bn, bk=bk, split=split, warps=warps, stages=stages)
                        try:
                            err = float((mm(x, w, **kw).float() - ref.float()).abs().max())
                            ms = graph_time_ms(lambda kw=kw: [mm(x, w, **kw) for _ in range(reps)]) / reps
                            row = {"proj": name, "impl": "triton", **kw, "us": 1e3 * ms,
                                   "of_F": fl / (ms * 1e-3) / flops, "max_abs_err": err}
                        except Exception as exc:  # noqa: BLE001
                            row = {"proj": name, "impl": "triton", **kw, "error": f"{type(exc).__name__}: {exc}"[:200]}
                        rows.append(row)
        best = min((r for r in rows if r["proj"] == name and "us" in r), key=lambda r: r["us"])
        log("best", json.dumps(best))
    res["small_m"] = rows


def argmax_section(res):
    """Greedy sampling's argmax over [256, 128256] bf16 logits: torch against kernels.argmax at three chunk sizes."""
    from pagestream.kernels.argmax import argmax

    x = torch.randn(256, 128256, dtype=torch.bfloat16, device="cuda")
    x[:, 5000] = 10
    x[:, 7000] = 10  # a tie: the first index wins
    rows = []
    reps = 16
    ms = graph_time_ms(lambda: [x.argmax(-1) for _ in range(reps)]) / reps
    rows.append({"impl": "torch", "us": 1e3 * ms})
    for chunk in (2048, 4096, 8192):
        ok = bool(torch.equal(argmax(x, chunk=chunk), x.argmax(-1)))
        ms = graph_time_ms(lambda chunk=chunk: [argmax(x, chunk=chunk) for _ in range(reps)]) / reps
        rows.append({"impl": "kernels.argmax", "chunk": chunk, "us": 1e3 * ms, "equal_to_torch": ok})
    for r in rows:
        log(json.dumps(r))
    res["argmax"] = rows


def first_use_section(res):
    """What the first decode step at a new batch size pays: the graph's first replay, and the LM head's
    matmul and argmax at a row count not met before (the steps at the end of a batch, as samples finish)."""
    from pagestream.engine import LLM

    llm = LLM(model_dir_for("llama-3.2-1b", torch.device("cuda")), device="cuda", dtype="bfloat16",
              gpu_memory_utilization=0.5, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)
    runner = llm.llm_engine.runner
    rows = []

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t)

    with torch.inference_mode():
        hidden = torch.randn(256, 2048, dtype=torch.bfloat16, device="cuda")
        for m in (224, 193, 161, 129, 97, 65, 34, 2):
            f = lambda m=m: runner.model.compute_logits(hidden[:m]).argmax(-1)  # noqa: E731
            rows.append({"what": "lm_head+argmax", "rows": m, "first_ms": timed(f), "second_ms": timed(f)})
            log(json.dumps(rows[-1]))
        for bs in (224, 208, 176, 144):
            graph, _ = runner.graphs[bs]
            rows.append({"what": "decode graph replay", "bs": bs, "first_ms": timed(graph.replay),
                         "second_ms": timed(graph.replay)})
            log(json.dumps(rows[-1]))
        for t in runner.mixed_sizes[-3:]:
            graph, _ = runner.mixed_graphs[t]
            rows.append({"what": "mixed graph replay", "tokens": t, "first_ms": timed(graph.replay),
                         "second_ms": timed(graph.replay)})
            log(json.dumps(rows[-1]))
    res["first_use"] = rows
    del llm


def tail_section(res, out_tokens: int):
    """The last steps of a batch, where its samples finish 32 at a time: wall time per step in three
    passes over fresh prompts of 512 tokens (the second under cProfile, the third with a timer around each
    phase of the step). Session 18's call 6 ran a torch-profiler pass in place of the timers."""
    import cProfile
    import io
    import pstats

    from pagestream.engine import LLM, SamplingParams

    llm = LLM(model_dir_for("llama-3.2-1b", torch.device("cuda")), device="cuda", dtype="bfloat16",
              gpu_memory_utilization=0.85, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)
    engine = llm.llm_engine
    rng = random.Random(9)
    vocab = SHAPES["llama-3.2-1b"]["vocab_size"]
    out = []
    acc: dict[str, float] = {}
    from pagestream.engine import sampler as sampler_mod
    from pagestream.engine import detokenizer as detok_mod

    with contextlib.ExitStack() as timers:  # the timers come off even if a pass fails
        for p in range(3):
            if p == 2:  # per-phase timers on the last pass
                timers.enter_context(timed_methods(acc, [
                    (engine.scheduler, "schedule", "schedule"), (engine.scheduler, "update_from_output", "update"),
                    (engine.scheduler, "append_tokens", "append_tokens"), (engine.scheduler, "finish", "finish"),
                    (engine.block_manager, "free", "free"), (engine.runner, "execute", "execute"),
                    (engine.runner, "prepare", "prepare"), (engine.runner, "release_rows", "release_rows"),
                    (engine.core, "_read_tokens", "read_tokens"), (engine.output_processor, "process", "outputs"),
                    (sampler_mod.HostSample, "wait", "wait_device"),
                    (detok_mod.IncrementalDetokenizer, "take_delta", "take_delta")]))
            sp = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True, output_kind="final")
            for i in range(256):
                engine.add_request(f"t{p}-{i}", prompt_token_ids=[rng.randrange(3, vocab) for _ in range(512)], params=sp)
            steps = []
            prof = cProfile.Profile() if p == 1 else None
            started = False
            while engine.has_unfinished_requests():
                n = len(engine.scheduler.running)
                if n < 256 and len(steps) > 20 and not started:
                    started = True
                    if prof:
                        prof.enable()
                acc.clear()
                t = time.perf_counter()
                engine.step()
                steps.append((n, 1e3 * (time.perf_counter() - t), {k: round(1e3 * v, 2) for k, v in acc.items()}))
            torch.cuda.synchronize()
            if prof:
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
                res["tail_cprofile"] = buf.getvalue()[-6000:]
                log(res["tail_cprofile"])
            out.append([(n, round(ms, 2), ph) for n, ms, ph in steps[-12:]])
            log("pass", p, out[-1])
    res["tail_steps"] = out
    del llm


SECTIONS = ("tail", "first_use", "engine", "prefill_attention", "small_m", "argmax", "matmul")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--skip", default="", help="sections to leave out, comma-separated: " + ", ".join(SECTIONS))
    ap.add_argument("--tail-tokens", type=int, default=48, help="output tokens per prompt in the tail section")
    args = ap.parse_args()
    res = {"argv": sys.argv, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    ceil = ceilings(torch.device("cuda"))
    res["ceilings"] = {"F_tflops": ceil["flops"] / 1e12, "bw_tb_s": ceil["bw"] / 1e12}
    log(json.dumps(res))

    def save():
        with open(os.path.join(args.out, "decode_probe.json"), "w") as f:
            json.dump(res, f, indent=1)

    def engine_and_attention():
        llm, bt, ctx, caches = engine_section(args, res)
        save()
        attention_section(args, res, bt, ctx, caches, ceil["bw"])
        del llm, caches

    sections = (("tail", lambda: tail_section(res, args.tail_tokens)), ("first_use", lambda: first_use_section(res)),
                ("engine", engine_and_attention), ("prefill_attention", lambda: prefill_attention_section(res)),
                ("small_m", lambda: small_m_section(res, ceil["flops"])), ("argmax", lambda: argmax_section(res)),
                ("matmul", lambda: matmul_section(res, ceil["flops"])))
    for name, fn in sections:
        if name in args.skip:
            continue
        try:
            fn()
        except Exception:  # noqa: BLE001
            res[name + "_error"] = traceback.format_exc()[-3000:]
            log(res[name + "_error"])
        save()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
