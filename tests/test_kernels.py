"""Triton kernels against the torch references, and the references against naive attention and HF.

Without a GPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1,
set here before triton is imported) in fp32 and fp16: the interpreter's bf16
tl.dot is broken upstream, so bf16 is checked on the GPU by bench/gpu_kernels.py.
With a GPU (and TRITON_INTERPRET unset) the same tests run the compiled kernels
on CUDA, bf16 included. Outputs and unused cache slots are NaN-poisoned, so an
element the kernel never wrote, or a slot it should not have read, fails.
"""
from __future__ import annotations

import math
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

import pytest  # noqa: E402

from pagestream.kernels import triton_ops as kernels  # noqa: E402
from pagestream.kernels import reference as R  # noqa: E402

if INTERPRET:
    # tests/conftest.py sets TRITON_INTERPRET=1 before any test module can import
    # triton; triton's own @jit helpers (tl.sum, ...) are built at its first import,
    # so check that it really happened in interpreter mode.
    import triton.language.standard
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton.language.standard.sum, InterpretedFunction), (
        "triton was imported before TRITON_INTERPRET=1 was set; set it before importing triton"
    )

DEV = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_paged(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, device=None):
    """A NaN-poisoned paged cache holding random K/V for each context, behind shuffled block tables
    whose entries past each sequence's last block are garbage, and queries for the last q_lens tokens."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_tables = torch.randint(0, num_blocks, (len(ctx_lens), max(blocks_per_seq) + 2), generator=g,
                                 dtype=torch.int32)
    used = 0
    for i, (c, nb) in enumerate(zip(ctx_lens, blocks_per_seq)):
        ids = perm[used:used + nb]
        used += nb
        block_tables[i, :nb] = ids
        pos = torch.arange(c)
        blocks = ids.long()[pos // block_size]
        k_cache[blocks, pos % block_size] = torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype)
        v_cache[blocks, pos % block_size] = torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return [t.to(device or DEV) for t in (q, k_cache, v_cache, block_tables, cu, ctx)]


def naive_attention(q, k_cache, v_cache, block_tables, cu, ctx):
    """Gather each context's K/V token by token and do a plain float64 softmax per query and head."""
    num_heads, num_kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(len(ctx)):
        c, start, end = int(ctx[i]), int(cu[i]), int(cu[i + 1])
        slots = [(int(block_tables[i, p // block_size]), p % block_size) for p in range(c)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).double()  # [c, kvh, d]
        v = torch.stack([v_cache[b, o] for b, o in slots]).double()
        for t in range(start, end):
            pos = c - (end - start) + (t - start)
            for h in range(num_heads):
                s = k[: pos + 1, h // group] @ q[t, h].double() / math.sqrt(q.shape[2])
                out[t, h] = torch.softmax(s, 0) @ v[: pos + 1, h // group]
    return out


def assert_close(out, ref, dtype):
    assert torch.isfinite(out).all(), "output has NaN/inf: an element was not written or a poisoned slot was read"
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=ATOL[dtype], rtol=ATOL[dtype])


# ------------------------------------------------------------------ references


def test_reference_attention_matches_naive():
    # fresh prefill, chunked prefill, a prefix-hit suffix, decode rows, GQA 4, block boundaries;
    # on the CPU, where the engine runs the references
    ctx_lens = [1, 16, 17, 40, 33, 70, 5]
    q_lens = [1, 16, 5, 1, 33, 20, 1]
    q, kc, vc, bt, cu, ctx = make_paged(ctx_lens, q_lens, 8, 2, 32, 16, torch.float32, seed=0, device="cpu")
    ref = naive_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), cu.cpu(), ctx.cpu())
    out = R.paged_prefill_attention(q, kc, vc, bt, cu, ctx, 32 ** -0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-5, rtol=1e-5)
    decode_rows = torch.tensor([0, 3, 6])
    out = R.paged_decode_attention(q[cu[decode_rows].long()], kc, vc, bt[decode_rows], ctx[decode_rows], 32 ** -0.5)
    torch.testing.assert_close(out.double().cpu(), ref[cu[decode_rows].long()], atol=1e-5, rtol=1e-5)


def test_reference_rope_and_norm_match_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 1024}
    for scaling in (None, llama3):
        cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          rope_theta=500000.0, rope_scaling=scaling)
        hf = LlamaRotaryEmbedding(cfg)
        cache = R.compute_cos_sin_cache(64, 4096, 500000.0, scaling, "cpu")
        pos = torch.randint(0, 4096, (37,), generator=torch.Generator().manual_seed(1))
        for dtype in (torch.float32, torch.bfloat16):
            q, k = torch.randn(37, 4, 64).to(dtype), torch.randn(37, 2, 64).to(dtype)
            cos, sin = hf(q, pos[None])
            hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
            rq, rk = R.rotary_embedding(pos, q, k, cache)
            assert torch.equal(rq, hq[0].transpose(0, 1)) and torch.equal(rk, hk[0].transpose(0, 1))
    norm = LlamaRMSNorm(96, eps=1e-6)
    norm.weight.data = torch.randn(96)
    for dtype in (torch.float32, torch.bfloat16):
        norm = norm.to(dtype)
        x, r = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
        assert torch.equal(R.rms_norm(x, norm.weight, 1e-6), norm(x))
        out, s = R.rms_norm(x, norm.weight, 1e-6, r)
        assert torch.equal(s, x + r) and torch.equal(out, norm(x + r))


# ------------------------------------------------------------------ attention kernels

# (GQA ratio, head_dim, block_size, dtype, num_splits)
DECODE_CASES = [
    (1, 64, 16, torch.float32, None),
    (4, 128, 32, torch.float16, None),
    (8, 64, 16, torch.float16, 3),
    (4, 64, 32, torch.float32, 4),
    (8, 128, 16, torch.float32, 1),
] + ([] if INTERPRET else [(4, 128, 16, torch.bfloat16, None), (8, 128, 256, torch.bfloat16, 5)])


@pytest.mark.parametrize("ratio,head_dim,block_size,dtype,num_splits", DECODE_CASES)
def test_paged_decode_attention(ratio, head_dim, block_size, dtype, num_splits):
    seed = ratio * 1000 + head_dim + block_size
    g = torch.Generator().manual_seed(seed)
    ctx_lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size, 300,
                int(torch.randint(2, 300, (1,), generator=g))]
    q, kc, vc, bt, _, ctx = make_paged(ctx_lens, [1] * len(ctx_lens), 2 * ratio, 2, head_dim, block_size, dtype, seed)
    out = torch.full_like(q, float("nan"))
    kernels.paged_decode_attention(q, kc, vc, bt, ctx, head_dim ** -0.5, out=out, num_splits=num_splits)
    ref = R.paged_decode_attention(q.float(), kc.float(), vc.float(), bt, ctx, head_dim ** -0.5)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_attention_program_order_does_not_change_the_result(num_splits):
    # the grid runs KV heads first by default (cache locality); sequences first must give the same numbers
    q, kc, vc, bt, _, ctx = make_paged([1, 17, 40, 300, 129], [1] * 5, 8, 2, 64, 16, torch.float32, 11)
    outs = [kernels.paged_decode_attention(q, kc, vc, bt, ctx, 0.125, num_splits=num_splits, heads_first=hf)
            for hf in (True, False)]
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[0], R.paged_decode_attention(q, kc, vc, bt, ctx, 0.125), torch.float32)


def test_padding_rows_with_empty_context_give_zeros():
    # CUDA-graph batches are padded with rows of context_len 0 (and garbage block tables)
    q, kc, vc, bt, cu, ctx = make_paged([40, 7], [1, 1], 8, 2, 64, 16, torch.float32, seed=5)
    ctx = torch.tensor([40, 0], dtype=torch.int32, device=DEV)
    for splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        kernels.paged_decode_attention(q, kc, vc, bt, ctx, 0.125, out=out, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert_close(out[:1], R.paged_decode_attention(q[:1], kc, vc, bt[:1], ctx[:1], 0.125), torch.float32)
    out = torch.full_like(q, float("nan"))
    cu = torch.tensor([0, 1, 1], dtype=torch.int32, device=DEV)  # the padding row has no queries
    kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, 0.125, out=out)
    assert_close(out[:1], R.paged_decode_attention(q[:1], kc, vc, bt[:1], ctx[:1], 0.125), torch.float32)


# (GQA ratio, head_dim, block_size, dtype, tile overrides)
PREFILL_CASES = [
    (1, 64, 16, torch.float32, {}),
    (4, 128, 32, torch.float16, {}),
    (8, 64, 16, torch.float16, {}),
    (4, 64, 32, torch.float32, {"block_m": 32, "block_n": 16}),
    (8, 128, 32, torch.float32, {"block_m": 16, "block_n": 32}),
] + ([] if INTERPRET else [(4, 128, 16, torch.bfloat16, {}), (8, 64, 64, torch.bfloat16, {})])


@pytest.mark.parametrize("ratio,head_dim,block_size,dtype,tiles", PREFILL_CASES)
def test_paged_prefill_attention_mixed_batch(ratio, head_dim, block_size, dtype, tiles):
    seed = ratio * 1000 + head_dim + block_size + 7
    g = torch.Generator().manual_seed(seed)
    r = int(torch.randint(2, 300, (1,), generator=g))
    # fresh prefills (one a block boundary), a chunk mid-context, a prefix-hit suffix,
    # decode rows, and a sequence with no queries this step
    ctx_lens = [block_size, 300, r, 200, 1, 2 * block_size + 1, 64]
    q_lens = [block_size, 100, r // 2 + 1, 1, 1, 1, 0]
    if dtype != torch.float32 and INTERPRET:  # fp16 dots are slow in the interpreter
        ctx_lens[1], q_lens[1] = 150, 60
    q, kc, vc, bt, cu, ctx = make_paged(ctx_lens, q_lens, 2 * ratio, 2, head_dim, block_size, dtype, seed)
    out = torch.full_like(q, float("nan"))
    kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, head_dim ** -0.5, out=out, **tiles)
    ref = R.paged_prefill_attention(q.float(), kc.float(), vc.float(), bt, cu, ctx, head_dim ** -0.5)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("ratio,head_dim,block_size,dtype,tiles", PREFILL_CASES[:3])
def test_paged_mixed_attention_sends_decode_rows_to_the_decode_kernel(ratio, head_dim, block_size, dtype, tiles):
    """A continuous-batching step (prompts, a chunk, decode rows, an empty sequence): the mixed op
    writes every row, equal to the one-pass reference; the decode kernel given the step's layout
    writes the one-query rows alone (split or not) and leaves every other row as it was."""
    seed = ratio * 1000 + head_dim + block_size + 11
    ctx_lens = [block_size, 150, 200, 1, 2 * block_size + 1, 64, 90]
    q_lens = [block_size, 60, 1, 1, 1, 0, 1]
    q, kc, vc, bt, cu, ctx = make_paged(ctx_lens, q_lens, 2 * ratio, 2, head_dim, block_size, dtype, seed)
    ref = R.paged_prefill_attention(q.float(), kc.float(), vc.float(), bt, cu, ctx, head_dim ** -0.5)
    out = torch.full_like(q, float("nan"))
    kernels.paged_mixed_attention(q, kc, vc, bt, cu, ctx, head_dim ** -0.5, out=out)
    assert_close(out, ref, dtype)

    single = torch.zeros(q.shape[0], dtype=torch.bool)
    for i, n in enumerate(q_lens):
        if n == 1:
            single[int(cu[i])] = True
    for splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        kernels.paged_decode_attention(q, kc, vc, bt, ctx, head_dim ** -0.5, out=out, cu_seqlens_q=cu, num_splits=splits)
        assert_close(out[single.to(out.device)], ref[single], dtype)
        assert torch.isnan(out[~single.to(out.device)]).all(), "a row of a longer sequence was written"


# ------------------------------------------------------------------ store, norm, rope


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size,index_dtype", [(1, 64, 16, torch.int64),
                                                                         (3, 128, 32, torch.int32),
                                                                         (8, 64, 16, torch.int32)])
def test_store_kvcache(dtype, num_kv_heads, head_dim, block_size, index_dtype):
    g = torch.Generator().manual_seed(num_kv_heads + head_dim)
    num_blocks, num_tokens = 12, 50
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(index_dtype)
    slots[::7] = -1
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype).to(DEV)
    # value as a strided view, as it comes out of a fused qkv projection
    value = torch.randn(num_tokens, num_kv_heads, 2 * head_dim, generator=g).to(dtype).to(DEV)[..., :head_dim]
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEV)
              for _ in range(4)]
    kernels.store_kvcache(key, value, caches[0], caches[1], slots.to(DEV))
    R.store_kvcache(key, value, caches[2], caches[3], slots.to(DEV))
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.isnan(), want.isnan()), "written slots differ"
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,chunk", [(1000, 8192), (1000, 128), (5003, 512)])
def test_argmax_picks_torchs_index_ties_and_nan_included(dtype, vocab, chunk):
    # greedy sampling's token: the first index of the row's maximum, also when the tie spans chunks
    g = torch.Generator().manual_seed(vocab + chunk)
    x = torch.randn(9, vocab, generator=g).to(dtype)
    x[1, [3, min(chunk, vocab - 2) + 1, vocab - 1]] = 7.0  # a tie across chunks: the first wins
    x[2, vocab - 1] = 9.0  # the max in the last, partial chunk
    x[3] = float("-inf")  # nothing allowed: index 0, as torch
    x[4, [17, 40]] = float("nan")  # NaN counts as the largest, as torch
    x[5, :] = 0.5  # all equal
    x = x.to(DEV)
    padded = torch.zeros(9, vocab + 5, dtype=dtype, device=DEV)
    padded[:, :vocab] = x  # a view with a row stride wider than the row, like logits of a padded vocabulary
    for rows in (x, padded[:, :vocab]):
        assert torch.equal(kernels.argmax(rows, chunk=chunk), R.argmax(rows))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 1000, 5000])
def test_silu_and_mul_equals_torch_elementwise(dtype, d):
    g = torch.Generator().manual_seed(d)
    x = (4 * torch.randn(7, 2 * d, generator=g)).to(dtype).to(DEV)
    out = torch.full((7, d), float("nan"), dtype=dtype, device=DEV)
    kernels.silu_and_mul(x, out=out)
    assert_close(out, R.silu_and_mul(x), dtype)
    # torch's two elementwise ops (HF's MLP), to within a few ulp (exp and division differ)
    exact = torch.nn.functional.silu(x[:, :d]) * x[:, d:]
    torch.testing.assert_close(out, exact, rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).tiny)
    with pytest.raises(ValueError, match="even"):
        kernels.silu_and_mul(x[:, :-1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_rms_norm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(9, hidden, generator=g).to(dtype).to(DEV)
    r = torch.randn(9, hidden, generator=g).to(dtype).to(DEV)
    w = torch.randn(hidden, generator=g).to(dtype).to(DEV)
    out = torch.full_like(x, float("nan"))
    kernels.rms_norm(x, w, 1e-6, out=out)
    assert_close(out, R.rms_norm(x, w, 1e-6), dtype)
    out, res = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    kernels.rms_norm(x, w, 1e-5, r, out=out, residual_out=res)
    ref, ref_res = R.rms_norm(x, w, 1e-5, r)
    assert_close(out, ref, dtype)
    assert torch.equal(res, ref_res)
    # [batch, seq, hidden] is flattened to rows
    out3, res3 = kernels.rms_norm(x.view(3, 3, hidden), w, 1e-5, r.view(3, 3, hidden))
    assert out3.shape == (3, 3, hidden) and torch.equal(out3.view(9, hidden), out) and torch.equal(res3.view(9, hidden), res)
    # in place on the residual stream, as the engine runs it
    r2 = r.clone()
    out2, res2 = kernels.rms_norm(x, w, 1e-5, r2, residual_out=r2)
    assert res2.data_ptr() == r2.data_ptr() and torch.equal(r2, ref_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,llama3", [(4, 2, 64, False), (9, 3, 128, True)])
def test_rotary_embedding(dtype, num_heads, num_kv_heads, head_dim, llama3):
    scaling = ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256} if llama3 else None)
    cache = R.compute_cos_sin_cache(head_dim, 2048, 10000.0, scaling, DEV)
    g = torch.Generator().manual_seed(head_dim)
    n = 13
    pos = torch.randint(0, 2048, (n,), generator=g).to(DEV)
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(DEV)
    q = qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(n, num_kv_heads, head_dim)
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    kernels.rotary_embedding(pos, q, k, cache, q_out=q_out, k_out=k_out)
    rq, rk = R.rotary_embedding(pos, q, k, cache)
    assert_close(q_out, rq, dtype)
    assert_close(k_out, rk, dtype)


# ------------------------------------------------------------------ wrapper checks and dispatch


def test_wrappers_reject_bad_input():
    q, kc, vc, bt, cu, ctx = make_paged([5, 9], [5, 1], 4, 2, 32, 16, torch.float32, seed=3)
    with pytest.raises(ValueError, match="block_tables"):
        kernels.paged_decode_attention(q[:2], kc, vc, bt.long(), ctx, 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernels.paged_decode_attention(q[:2, :3], kc, vc, bt, ctx, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.paged_prefill_attention(q[..., :24], kc[..., :24], vc[..., :24], bt, cu, ctx, 1.0)
    with pytest.raises(ValueError, match="dtypes differ"):
        kernels.paged_prefill_attention(q.half(), kc, vc, bt, cu, ctx, 1.0)
    with pytest.raises(ValueError, match="number of sequences"):
        kernels.paged_prefill_attention(q, kc, vc, bt, cu[:-1], ctx, 1.0)
    with pytest.raises(ValueError, match="out must be"):
        kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, 1.0, out=torch.empty(3, 4, 32, device=DEV))
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.store_kvcache(q[:, :2], q[:, :2], kc, vc, torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="stride 1"):
        kernels.rms_norm(q[:, 0, ::2], torch.ones(16, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="partial rotary"):
        kernels.rotary_embedding(torch.zeros(6, dtype=torch.long, device=DEV), q, q[:, :2],
                                 torch.zeros(8, 16, device=DEV))


def test_use_triton(monkeypatch):
    monkeypatch.delenv("PAGESTREAM_KERNELS", raising=False)
    assert kernels.use_triton("cuda") and kernels.use_triton(torch.device("cuda", 1))
    assert not kernels.use_triton("cpu")
    monkeypatch.setenv("PAGESTREAM_KERNELS", "torch")
    assert not kernels.use_triton("cuda")


@pytest.mark.parametrize("seed", range(8))
def test_attention_fuzz(seed):
    """Random mixed batches: GQA 1/4/8, head_dim 64/128, block_size 16/32, fp32/fp16, contexts 1..300."""
    g = torch.Generator().manual_seed(100 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    ratio, head_dim, block_size, dtype = pick([1, 4, 8]), pick([64, 128]), pick([16, 32]), pick(DTYPES)
    num_seqs = int(torch.randint(2, 6, (1,), generator=g))
    ctx_lens = [pick([1, block_size, block_size + 1, int(torch.randint(1, 301, (1,), generator=g))])
                for _ in range(num_seqs)]
    q_lens = [pick([1, c, int(torch.randint(1, c + 1, (1,), generator=g))]) for c in ctx_lens]
    if INTERPRET and dtype != torch.float32:  # fp16 dots are slow in the interpreter
        q_lens = [min(q, 64) for q in q_lens]
    q, kc, vc, bt, cu, ctx = make_paged(ctx_lens, q_lens, 2 * ratio, 2, head_dim, block_size, dtype, 100 + seed)
    out = torch.full_like(q, float("nan"))
    kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, head_dim ** -0.5, out=out)
    ref = R.paged_prefill_attention(q.float(), kc.float(), vc.float(), bt, cu, ctx, head_dim ** -0.5)
    assert_close(out, ref, dtype)
    out = torch.full_like(q, float("nan"))
    kernels.paged_mixed_attention(q, kc, vc, bt, cu, ctx, head_dim ** -0.5, out=out)
    assert_close(out, ref, dtype)
    last = (cu[1:] - 1).long()  # each sequence's last query is a decode row over its whole context
    out = torch.full_like(q[last], float("nan"))
    kernels.paged_decode_attention(q[last], kc, vc, bt, ctx, head_dim ** -0.5, out=out)
    assert_close(out, R.paged_decode_attention(q[last].float(), kc.float(), vc.float(), bt, ctx, head_dim ** -0.5), dtype)
