"""Check every Triton kernel in bf16 against kernels.reference on the GPU, then time them.

    python3 bench/gpu_kernels.py [--quick] [--sweep] [--json PATH]

Checks: fresh random inputs per case, outputs (and unused cache slots) poisoned
with NaN, relative error ||out - ref|| / ||ref|| < 1e-2 (references compute in
fp32). Timings: triton.testing.do_bench medians. Decode attention is reported as
achieved bandwidth (K/V bytes read / time) against a device-to-device copy
(bytes read + written) measured in the same run; prefill attention as TFLOP/s
(causal FLOPs) beside torch's flash SDPA on the same shapes with contiguous K/V.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


import torch  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from pagestream.kernels import triton_ops as kernels  # noqa: E402
from pagestream.kernels import reference as R  # noqa: E402

DEV = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu" + TRITON_INTERPRET=1: smoke test of the checks
MAX_CTX = int(os.environ.get("BENCH_CHECK_MAX_CTX", "3000"))
BF16 = torch.bfloat16
RESULTS: dict = {"checks": [], "decode": [], "decode_block_size": [], "prefill": [], "elementwise": [], "sweep": []}


def bench(fn) -> float:
    """Median milliseconds."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def record_check(name: str, err: float, tol: float = 1e-2) -> bool:
    ok = err == err and err < tol  # NaN fails
    RESULTS["checks"].append({"name": name, "rel_err": err, "ok": ok})
    print(f"check {'OK  ' if ok else 'FAIL'} {name}: rel_err={err:.2e}", flush=True)
    return ok


# ---------------------------------------------------------------- inputs


def make_paged(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, extra_blocks=3, gen=None):
    """Random paged cache (unused slots NaN), shuffled block tables, queries for the last q_lens tokens."""
    blocks_per_seq = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    max_blocks = max(blocks_per_seq) + 2
    # Garbage past each sequence's last block: the kernels must not read it.
    block_tables = torch.randint(0, num_blocks, (len(ctx_lens), max_blocks), dtype=torch.int32, device=DEV)
    used = 0
    for i, (c, nb) in enumerate(zip(ctx_lens, blocks_per_seq)):
        ids = perm[used:used + nb]
        used += nb
        block_tables[i, :nb] = ids
        flat_k = torch.randn(c, num_kv_heads, head_dim, device=DEV, dtype=dtype)
        flat_v = torch.randn(c, num_kv_heads, head_dim, device=DEV, dtype=dtype)
        pos = torch.arange(c, device=DEV)
        b = ids.long()[pos // block_size]
        k_cache[b, pos % block_size] = flat_k
        v_cache[b, pos % block_size] = flat_v
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=DEV, dtype=dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEV)
    cu[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    return q, k_cache, v_cache, block_tables, cu, ctx


# ---------------------------------------------------------------- checks


def check_all(dtype=BF16) -> bool:
    ok = True
    g = torch.Generator().manual_seed(1)

    def rint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    tag = str(dtype).replace("torch.", "")
    # decode: GQA ratios 1..8, head dims 64/128, block sizes 16..256, split or not
    for ratio, head_dim, block_size, splits in [(1, 128, 16, None), (4, 128, 16, 1), (8, 128, 32, 4), (2, 64, 64, None),
                                                 (4, 64, 128, 7), (8, 128, 256, None), (4, 128, 16, 16)]:
        kvh = 2 if ratio == 8 else 4
        ctx_lens = [rint(1, MAX_CTX) for _ in range(9)] + [1, block_size, block_size + 1]
        q, kc, vc, bt, _, ctx = make_paged(ctx_lens, [1] * len(ctx_lens), kvh * ratio, kvh, head_dim, block_size, dtype)
        out = torch.full_like(q, float("nan"))
        kernels.paged_decode_attention(q, kc, vc, bt, ctx, head_dim ** -0.5, out=out, num_splits=splits)
        ref = R.paged_decode_attention(q.float(), kc.float(), vc.float(), bt, ctx, head_dim ** -0.5)
        ok &= record_check(f"decode {tag} ratio={ratio} d={head_dim} bs={block_size} splits={splits}", rel_err(out, ref))
    # prefill / mixed: fresh prefill, chunked prefill, prefix hits, decode rows
    for ratio, head_dim, block_size in [(1, 128, 16), (4, 128, 16), (8, 128, 32), (4, 64, 64), (8, 64, 256)]:
        kvh = 2 if ratio == 8 else 4
        ctx_lens, q_lens = [], []
        for kind in ["full", "full", "chunk", "chunk", "decode", "decode", "decode", "full"]:
            c = rint(1, MAX_CTX // 2)
            ctx_lens.append(c)
            q_lens.append(c if kind == "full" else 1 if kind == "decode" else rint(1, c))
        q, kc, vc, bt, cu, ctx = make_paged(ctx_lens, q_lens, kvh * ratio, kvh, head_dim, block_size, dtype)
        out = torch.full_like(q, float("nan"))
        kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, head_dim ** -0.5, out=out)
        ref = R.paged_prefill_attention(q.float(), kc.float(), vc.float(), bt, cu, ctx, head_dim ** -0.5)
        ok &= record_check(f"prefill {tag} ratio={ratio} d={head_dim} bs={block_size}", rel_err(out, ref))
    # store_kvcache: written slots equal, the rest untouched (NaN)
    for kvh, head_dim, block_size in [(8, 128, 16), (2, 64, 32), (5, 128, 256)]:
        nb, t = 64, 300
        slots = torch.randperm(nb * block_size, device=DEV)[:t]
        slots[::7] = -1
        key = torch.randn(t, kvh, head_dim, device=DEV, dtype=dtype)
        val = torch.randn(t, kvh, 2 * head_dim, device=DEV, dtype=dtype)[:, :, :head_dim]  # strided view
        caches = [torch.full((nb, block_size, kvh, head_dim), float("nan"), device=DEV, dtype=dtype) for _ in range(4)]
        kernels.store_kvcache(key, val, caches[0], caches[1], slots)
        R.store_kvcache(key, val, caches[2], caches[3], slots)
        same = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in ((caches[0], caches[2]), (caches[1], caches[3])))
        ok &= record_check(f"store_kvcache {tag} kvh={kvh} d={head_dim} bs={block_size}", 0.0 if same else float("nan"))
    # rms_norm with and without residual
    for hidden in [576, 4096, 5120]:
        x = torch.randn(57 if DEV == "cpu" else 257, hidden, device=DEV, dtype=dtype)
        r = torch.randn_like(x)
        w = torch.randn(hidden, device=DEV, dtype=dtype)
        out = torch.full_like(x, float("nan"))
        kernels.rms_norm(x, w, 1e-6, out=out)
        ok &= record_check(f"rms_norm {tag} hidden={hidden}", rel_err(out, R.rms_norm(x, w, 1e-6)))
        out, res = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        kernels.rms_norm(x, w, 1e-5, r, out=out, residual_out=res)
        ref, ref_res = R.rms_norm(x, w, 1e-5, r)
        ok &= record_check(f"rms_norm+residual {tag} hidden={hidden}", max(rel_err(out, ref), rel_err(res, ref_res)))
    # rotary, default and llama3 scaling
    for heads, kvh, head_dim, scaling in [(32, 8, 128, None), (9, 3, 64, None),
                                          (32, 8, 128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})]:
        cache = R.compute_cos_sin_cache(head_dim, 32768, 500000.0, scaling, DEV)
        n = 33 if DEV == "cpu" else 333
        pos = torch.randint(0, 32768, (n,), device=DEV)
        q = torch.randn(n, heads, head_dim, device=DEV, dtype=dtype)
        k = torch.randn(n, kvh, head_dim, device=DEV, dtype=dtype)
        qo, ko = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
        kernels.rotary_embedding(pos, q, k, cache, q_out=qo, k_out=ko)
        rq, rk = R.rotary_embedding(pos, q, k, cache)
        ok &= record_check(f"rotary {tag} H={heads} kvh={kvh} d={head_dim} llama3={scaling is not None}",
                           max(rel_err(qo, rq), rel_err(ko, rk)))
    return ok


# ---------------------------------------------------------------- timing


def copy_rate_gbps() -> float:
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device=DEV, dtype=BF16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * n * 2 / (ms * 1e-3) / 1e9


class DecodeSetup:
    """One big random bf16 cache; each shape gets shuffled block tables into it."""

    def __init__(self, max_tokens: int, num_kv_heads=8, head_dim=128):
        self.kvh, self.d = num_kv_heads, head_dim
        self.k = torch.randn(max_tokens, num_kv_heads, head_dim, device=DEV, dtype=BF16)
        self.v = torch.randn_like(self.k)

    def shape(self, batch, ctx, block_size, num_heads=32):
        nb_total = self.k.shape[0] // block_size
        kc = self.k.view(nb_total, block_size, self.kvh, self.d)
        vc = self.v.view(nb_total, block_size, self.kvh, self.d)
        nb = ctx // block_size
        bt = torch.randperm(nb_total, device=DEV)[: batch * nb].view(batch, nb).to(torch.int32)
        cl = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, num_heads, self.d, device=DEV, dtype=BF16)
        return q, kc, vc, bt, cl


def bench_graph(fn) -> float:
    """Median milliseconds of fn replayed from a CUDA graph (no launch overhead), as the engine runs decode."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def decode_ms(setup: DecodeSetup, batch: int, ctx: int, block_size: int = 16, eager: bool = True,
              **kw) -> tuple[float, float | None]:
    """(graph ms, eager ms or None) per call. The graph runs over enough distinct random inputs to touch
    >= 1 GB, so repeated replays do not read K/V from the 60 MB L2."""
    kv_bytes = batch * ctx * setup.kvh * setup.d * 2 * 2
    n_sets = max(1, min(16, math.ceil(1e9 / kv_bytes)))
    sets = [setup.shape(batch, ctx, block_size) for _ in range(n_sets)]
    graph_ms = bench_graph(lambda: [kernels.paged_decode_attention(*s, 128 ** -0.5, **kw) for s in sets]) / n_sets
    eager_ms = bench(lambda: kernels.paged_decode_attention(*sets[0], 128 ** -0.5, **kw)) if eager else None
    return graph_ms, eager_ms


def time_decode(setup: DecodeSetup, copy_gbps: float, batches, ctxs, block_sizes=(16,), **kw):
    rows = []
    for block_size in block_sizes:
        for batch in batches:
            for ctx in ctxs:
                ms, eager_ms = decode_ms(setup, batch, ctx, block_size, **kw)
                kv_bytes = batch * ctx * setup.kvh * setup.d * 2 * 2
                gbps = kv_bytes / (ms * 1e-3) / 1e9
                rows.append({"batch": batch, "ctx": ctx, "block_size": block_size, "ms": ms, "eager_ms": eager_ms,
                             "GBps": gbps, "frac_copy": gbps / copy_gbps})
                print(f"decode b={batch:4d} ctx={ctx:5d} bs={block_size:3d}: graph {ms * 1e3:8.1f} us {gbps:7.0f} GB/s "
                      f"{gbps / copy_gbps:5.2f} of copy | eager {eager_ms * 1e3:8.1f} us", flush=True)
    return rows


def sweep_decode(setup: DecodeSetup):
    for batch, ctx in [(32, 512), (64, 512), (32, 2048), (64, 2048), (32, 8192), (128, 2048), (256, 512)]:
        res = {}
        for ns in (1, 2, 3, 4, 8):
            for block_n, warps, stages in ((64, 4, 3), (32, 2, 3), (32, 4, 3), (64, 2, 3)):
                ms, _ = decode_ms(setup, batch, ctx, eager=False, num_splits=ns, block_n=block_n, num_warps=warps,
                                  num_stages=stages)
                res[(ns, block_n, warps, stages)] = ms
                RESULTS["sweep"].append({"kernel": "decode", "batch": batch, "ctx": ctx, "splits": ns, "block_n": block_n,
                                         "warps": warps, "stages": stages, "graph_ms": ms})
        best = min(res, key=res.get)
        default_ms, _ = decode_ms(setup, batch, ctx, eager=False)
        print(f"sweep decode b={batch} ctx={ctx}: default {default_ms * 1e3:.1f} us; best {res[best] * 1e3:.1f} us at "
              f"splits/block_n/warps/stages={best}; by splits (64/4/3): "
              + " ".join(f"{ns}:{res[(ns, 64, 4, 3)] * 1e3:.1f}" for ns in (1, 2, 3, 4, 8)), flush=True)


def sweep_decode_d64(copy_gbps: float):
    """Llama-3.2-1B's decode attention (32 query heads over 8 KV heads of 64): 256 sequences at
    the contexts of the 1B workloads, every tile config, against the copy rate."""
    setup = DecodeSetup(256 * 1024, num_kv_heads=8, head_dim=64)
    rows = []
    for batch, ctx in [(256, 512), (256, 768), (256, 1024)]:
        kv_bytes = batch * ctx * 8 * 64 * 2 * 2
        default_ms, _ = decode_ms(setup, batch, ctx, eager=False)
        res = {}
        for block_n in (32, 64, 128, 256):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    try:
                        ms, _ = decode_ms(setup, batch, ctx, eager=False, block_n=block_n, num_warps=warps, num_stages=stages)
                    except Exception as e:  # out of shared memory / registers
                        print(f"d64 b={batch} ctx={ctx} {block_n}/{warps}/{stages}: {type(e).__name__}", flush=True)
                        continue
                    res[(block_n, warps, stages)] = ms
                    rows.append({"batch": batch, "ctx": ctx, "block_n": block_n, "warps": warps, "stages": stages,
                                 "graph_ms": ms, "frac_copy": kv_bytes / (ms * 1e-3) / 1e9 / copy_gbps})
        best = min(res, key=res.get)
        print(f"sweep d64 b={batch} ctx={ctx}: default {default_ms * 1e3:.1f} us "
              f"({kv_bytes / (default_ms * 1e-3) / 1e9 / copy_gbps:.2f} of copy); best {res[best] * 1e3:.1f} us "
              f"({kv_bytes / (res[best] * 1e-3) / 1e9 / copy_gbps:.2f} of copy) at block_n/warps/stages={best}", flush=True)
        rows.append({"batch": batch, "ctx": ctx, "default_ms": default_ms, "best": list(best), "best_ms": res[best]})
    RESULTS["sweep_d64"] = rows


def prefill_inputs(batch, seqlen, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, q_len=None):
    q_len = q_len or seqlen
    k = torch.randn(batch, seqlen, num_kv_heads, head_dim, device=DEV, dtype=BF16)
    v = torch.randn_like(k)
    nb = seqlen // block_size
    perm = torch.randperm(batch * nb, device=DEV)
    kc = torch.empty(batch * nb, block_size, num_kv_heads, head_dim, device=DEV, dtype=BF16)
    vc = torch.empty_like(kc)
    kc[perm] = k.view(batch * nb, block_size, num_kv_heads, head_dim)
    vc[perm] = v.view(batch * nb, block_size, num_kv_heads, head_dim)
    bt = perm.view(batch, nb).to(torch.int32)
    q = torch.randn(batch * q_len, num_heads, head_dim, device=DEV, dtype=BF16)
    cu = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=DEV)
    ctx = torch.full((batch,), seqlen, dtype=torch.int32, device=DEV)
    return q, k, v, kc, vc, bt, cu, ctx


def causal_flops(batch, q_len, ctx, num_heads=32, head_dim=128):
    first = ctx - q_len
    pairs = sum(first + i + 1 for i in range(q_len))
    return 4 * batch * num_heads * head_dim * pairs


def time_prefill(shapes, **kw):
    rows = []
    for batch, seqlen in shapes:
        q, k, v, kc, vc, bt, cu, ctx = prefill_inputs(batch, seqlen)
        flops = causal_flops(batch, seqlen, seqlen)
        ms = bench(lambda: kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, 128 ** -0.5, seqlen, **kw))
        # torch flash SDPA: [B, H, L, d], K/V repeated to all query heads, contiguous
        qs = q.view(batch, seqlen, 32, 128).transpose(1, 2).contiguous()
        ks = k.repeat_interleave(4, dim=2).transpose(1, 2).contiguous()
        vs = v.repeat_interleave(4, dim=2).transpose(1, 2).contiguous()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa_ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
            ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        out = kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, 128 ** -0.5, seqlen, **kw)
        err = rel_err(out.view(batch, seqlen, 32, 128).transpose(1, 2), ref)
        tf, tf_sdpa = flops / ms / 1e9, flops / sdpa_ms / 1e9
        rows.append({"batch": batch, "seqlen": seqlen, "ms": ms, "TFLOPs": tf, "sdpa_ms": sdpa_ms, "sdpa_TFLOPs": tf_sdpa,
                     "ratio": tf / tf_sdpa, "rel_err_vs_sdpa": err})
        print(f"prefill {batch}x{seqlen}: ours {ms:.3f} ms {tf:6.1f} TFLOP/s | flash SDPA {sdpa_ms:.3f} ms {tf_sdpa:6.1f} "
              f"TFLOP/s | ratio {tf / tf_sdpa:.2f} | rel_err vs SDPA {err:.1e}", flush=True)
    return rows


def time_mixed():
    """A chunked-prefill step: 4 chunks of 1024 queries at the end of 4096-token contexts + 128 decode rows."""
    ctx_lens = [4096] * 4 + [2048] * 128
    q_lens = [1024] * 4 + [1] * 128
    q, kc, vc, bt, cu, ctx = make_paged(ctx_lens, q_lens, 32, 8, 128, 16, BF16)
    flops = causal_flops(4, 1024, 4096) + causal_flops(128, 1, 2048)
    ms = bench(lambda: kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, 128 ** -0.5))
    print(f"mixed step (4 x 1024-query chunks @4096 + 128 decode rows @2048): {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s",
          flush=True)
    return {"ms": ms, "TFLOPs": flops / ms / 1e9}


def mixed_d64(copy_gbps: float) -> dict:
    """Llama-3.2-1B's attention (32 query / 8 KV heads, head_dim 64) in a continuous-batching step:
    256 decode rows at ~600-token contexts through the decode kernel, the same rows through the
    prefill kernel (as a mixed step runs them today), and with one 300-token prompt added."""
    scale = 64 ** -0.5
    dec_ctx = [600] * 256
    q, kc, vc, bt, cu, ctx = make_paged(dec_ctx, [1] * 256, 32, 8, 64, 16, BF16)
    kv_bytes = sum(dec_ctx) * 8 * 64 * 2 * 2
    out = {"decode_kernel_ms": bench(lambda: kernels.paged_decode_attention(q, kc, vc, bt, ctx, scale)),
           "prefill_kernel_on_decode_rows_ms": bench(lambda: kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, scale))}
    q2, kc2, vc2, bt2, cu2, ctx2 = make_paged(dec_ctx + [300], [1] * 256 + [300], 32, 8, 64, 16, BF16)
    out["prefill_kernel_mixed_256_decode_plus_300_prompt_ms"] = bench(
        lambda: kernels.paged_prefill_attention(q2, kc2, vc2, bt2, cu2, ctx2, scale))
    out["mixed_op_256_decode_plus_300_prompt_ms"] = bench(
        lambda: kernels.paged_mixed_attention(q2, kc2, vc2, bt2, cu2, ctx2, scale))
    ref = kernels.paged_prefill_attention(q2, kc2, vc2, bt2, cu2, ctx2, scale)
    out["mixed_op_rel_err_vs_prefill_kernel"] = rel_err(kernels.paged_mixed_attention(q2, kc2, vc2, bt2, cu2, ctx2, scale), ref)
    q3, kc3, vc3, bt3, cu3, ctx3 = make_paged([300], [300], 32, 8, 64, 16, BF16)
    out["prefill_kernel_300_prompt_alone_ms"] = bench(lambda: kernels.paged_prefill_attention(q3, kc3, vc3, bt3, cu3, ctx3, scale))
    out["kv_bytes_floor_ms"] = kv_bytes / (copy_gbps * 1e9) * 1e3
    print("mixed d64:", json.dumps(out), flush=True)
    return out


def sweep_prefill():
    batch, seqlen = 4, 4096
    q, k, v, kc, vc, bt, cu, ctx = prefill_inputs(batch, seqlen)
    flops = causal_flops(batch, seqlen, seqlen)
    for bm, bn, w, s in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
                         (128, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2), (64, 64, 4, 4),
                         (256, 64, 8, 2)]:
        try:
            ms = bench(lambda: kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, 0.1, block_m=bm, block_n=bn,
                                                               num_warps=w, num_stages=s))
        except Exception as e:
            print(f"sweep prefill {bm}/{bn}/{w}/{s}: {type(e).__name__}")
            continue
        RESULTS["sweep"].append({"kernel": "prefill", "block_m": bm, "block_n": bn, "warps": w, "stages": s, "ms": ms})
        print(f"sweep prefill 4x4096 block_m={bm} block_n={bn} warps={w} stages={s}: {flops / ms / 1e9:6.1f} TFLOP/s",
              flush=True)


def time_elementwise():
    rows = []
    t, hidden, heads, kvh, d = 8192, 4096, 32, 8, 128
    x = torch.randn(t, hidden, device=DEV, dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device=DEV, dtype=BF16)
    for name, tri, ref, nbytes in [
        ("rms_norm", lambda: kernels.rms_norm(x, w, 1e-6), lambda: R.rms_norm(x, w, 1e-6), 2 * x.numel() * 2),
        ("rms_norm+residual", lambda: kernels.rms_norm(x, w, 1e-6, r), lambda: R.rms_norm(x, w, 1e-6, r),
         4 * x.numel() * 2),
    ]:
        rows.append(_time_pair(name, tri, ref, nbytes))
    cache = R.compute_cos_sin_cache(d, 32768, 500000.0, None, DEV)
    pos = torch.randint(0, 32768, (t,), device=DEV)
    qkv = torch.randn(t, (heads + 2 * kvh) * d, device=DEV, dtype=BF16)
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d: (heads + kvh) * d].view(t, kvh, d)
    rows.append(_time_pair("rotary (q,k views of qkv)", lambda: kernels.rotary_embedding(pos, q, k, cache),
                           lambda: R.rotary_embedding(pos, q, k, cache), 2 * (heads + kvh) * d * t * 2))
    key = torch.randn(t, kvh, d, device=DEV, dtype=BF16)
    kc = torch.empty(t // 16 + 8, 16, kvh, d, device=DEV, dtype=BF16)
    vc = torch.empty_like(kc)
    slots = torch.randperm(kc.shape[0] * 16, device=DEV)[:t]
    rows.append(_time_pair("store_kvcache", lambda: kernels.store_kvcache(key, key, kc, vc, slots),
                           lambda: R.store_kvcache(key, key, kc, vc, slots), 4 * key.numel() * 2))
    return rows


def _time_pair(name, tri, ref, nbytes):
    ms, ref_ms = bench(tri), bench(ref)
    print(f"{name}: triton {ms * 1e3:7.1f} us ({nbytes / ms / 1e6:6.0f} GB/s) | torch {ref_ms * 1e3:7.1f} us | "
          f"speedup {ref_ms / ms:.2f}x", flush=True)
    return {"name": name, "us": ms * 1e3, "torch_us": ref_ms * 1e3, "speedup": ref_ms / ms, "GBps": nbytes / ms / 1e6}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="checks and a small timing set only")
    ap.add_argument("--sweep", action="store_true", help="also sweep tile configs")
    ap.add_argument("--sweep-d64-only", action="store_true", help="only the head_dim-64 decode tile sweep (1B shape)")
    ap.add_argument("--mixed-d64-only", action="store_true", help="only the 1B-shape mixed-step attention timing")
    ap.add_argument("--no-fp16", action="store_true", help="check bf16 only")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "gpu_kernels.json"))
    args = ap.parse_args()
    t0 = time.time()
    props = torch.cuda.get_device_properties(0) if DEV == "cuda" else None
    RESULTS["env"] = {"device": props and props.name, "sms": props and props.multi_processor_count,
                      "torch": torch.__version__, "triton": triton.__version__}
    print(RESULTS["env"], flush=True)
    torch.manual_seed(0)
    if args.sweep_d64_only or args.mixed_d64_only:
        copy = copy_rate_gbps()
        RESULTS["copy_GBps"] = copy
        if args.sweep_d64_only:
            sweep_decode_d64(copy)
        if args.mixed_d64_only:
            RESULTS["mixed_d64"] = mixed_d64(copy)
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)
        return 0
    ok = check_all(BF16)
    if not args.no_fp16:
        ok &= check_all(torch.float16)
    if DEV == "cpu":
        return 0 if ok else 1
    print(f"checks {'all passed' if ok else 'FAILED'} ({time.time() - t0:.0f} s)", flush=True)

    copy = copy_rate_gbps()
    RESULTS["copy_GBps"] = copy
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write)", flush=True)
    batches, ctxs = ((64,), (2048,)) if args.quick else ((32, 64, 128, 256), (512, 2048, 8192))
    setup = DecodeSetup(max(batches) * max(ctxs))
    RESULTS["decode"] = time_decode(setup, copy, batches, ctxs)
    if not args.quick:
        RESULTS["decode_block_size"] = time_decode(setup, copy, (64, 256), (2048,), block_sizes=(32, 64, 128, 256))
    if args.sweep:
        sweep_decode(setup)
    del setup
    torch.cuda.empty_cache()
    shapes = [(4, 4096)] if args.quick else [(16, 1024), (8, 2048), (4, 4096), (2, 8192)]
    RESULTS["prefill"] = time_prefill(shapes)
    RESULTS["mixed"] = time_mixed()
    if args.sweep:
        sweep_prefill()
    RESULTS["elementwise"] = time_elementwise()
    with open(args.json, "w") as f:
        json.dump(RESULTS, f, indent=1)
    print(f"done in {time.time() - t0:.0f} s; checks {'all passed' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
