"""Sliding-window attention and attention-logit soft-capping (Mistral, Gemma 2): the Triton
decode and prefill kernels against the torch references on fuzzed shapes, the references
against a naive float64 attention, and the wrappers' checks.

Cache blocks wholly outside every query's window are NaN-poisoned after the data is
written, so a kernel that reads one (instead of skipping it) fails.
"""
from __future__ import annotations

import math

import pytest
import torch

from pagestream.kernels import triton_ops as kernels
from pagestream.kernels import reference as R
from test_kernels import DTYPES, INTERPRET, assert_close, make_paged


def poison_outside_window(kc, vc, bt, cu, ctx, window):
    """NaN into every block that no query of its sequence can see; returns how many blocks."""
    block_size = kc.shape[1]
    poisoned = 0
    for i in range(len(ctx)):
        q_len, c = int(cu[i + 1] - cu[i]), int(ctx[i])
        first_visible = max(0, c - q_len - window + 1) if q_len else c
        for j in range(first_visible // block_size):
            kc[int(bt[i, j])] = float("nan")
            vc[int(bt[i, j])] = float("nan")
            poisoned += 1
    return poisoned


def naive(q, kc, vc, bt, cu, ctx, scale, window=None, softcap=None):
    """Token-by-token float64 attention with the window and the cap written out plainly."""
    num_heads, num_kv_heads, block_size = q.shape[1], kc.shape[2], kc.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(len(ctx)):
        c, start, end = int(ctx[i]), int(cu[i]), int(cu[i + 1])
        for t in range(start, end):
            pos = c - (end - start) + (t - start)
            first = 0 if window is None else max(0, pos - window + 1)
            slots = [(int(bt[i, p // block_size]), p % block_size) for p in range(first, pos + 1)]
            k = torch.stack([kc[b, o] for b, o in slots]).double()
            v = torch.stack([vc[b, o] for b, o in slots]).double()
            for h in range(num_heads):
                s = k[:, h // group] @ q[t, h].double() * scale
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                out[t, h] = torch.softmax(s, 0) @ v[:, h // group]
    return out


@pytest.mark.parametrize("window,softcap", [(5, None), (16, 30.0), (None, 2.0), (24, 50.0)])
def test_references_match_naive(window, softcap):
    ctx_lens = [1, 16, 17, 40, 70, 33]
    q_lens = [1, 16, 5, 1, 20, 33]
    q, kc, vc, bt, cu, ctx = make_paged(ctx_lens, q_lens, 8, 2, 32, 16, torch.float32, seed=3, device="cpu")
    ref = naive(q, kc, vc, bt, cu, ctx, 0.3, window, softcap)
    if window is not None:
        assert poison_outside_window(kc, vc, bt, cu, ctx, window) > 0
    out = R.paged_prefill_attention(q, kc, vc, bt, cu, ctx, 0.3, sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    rows = (cu[1:] - 1).long()
    out = R.paged_decode_attention(q[rows], kc, vc, bt, ctx, 0.3, sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(out.double(), ref[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(10))
def test_window_and_softcap_fuzz(seed):
    """Random mixed batches with a random window (1 token to longer than the context) and/or cap."""
    g = torch.Generator().manual_seed(500 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    ratio, head_dim, block_size, dtype = pick([1, 4, 8]), pick([32, 64]), pick([8, 16, 32]), pick(DTYPES)
    window = pick([1, 3, block_size, block_size + 5, 50, 400, None])
    softcap = pick([None, 1.5, 20.0, 50.0])
    if window is None and softcap is None:
        softcap = 10.0
    num_seqs = int(torch.randint(2, 6, (1,), generator=g))
    ctx_lens = [pick([1, block_size, block_size + 1, int(torch.randint(1, 200, (1,), generator=g))])
                for _ in range(num_seqs)]
    q_lens = [pick([1, c, int(torch.randint(1, c + 1, (1,), generator=g))]) for c in ctx_lens]
    if INTERPRET and dtype != torch.float32:  # fp16 dots are slow in the interpreter
        q_lens = [min(q, 48) for q in q_lens]
    q, kc, vc, bt, cu, ctx = make_paged(ctx_lens, q_lens, 2 * ratio, 2, head_dim, block_size, dtype, 500 + seed)
    scale = head_dim ** -0.5
    ref = R.paged_prefill_attention(q.float(), kc.float(), vc.float(), bt, cu, ctx, scale,
                                    sliding_window=window, logit_softcap=softcap)
    last = (cu[1:] - 1).long()
    ref_dec = R.paged_decode_attention(q[last].float(), kc.float(), vc.float(), bt, ctx, scale,
                                       sliding_window=window, logit_softcap=softcap)
    if window is not None:
        poison_outside_window(kc, vc, bt, cu, ctx, window)
    out = torch.full_like(q, float("nan"))
    tiles = pick([{}, {"block_m": 16, "block_n": 16}, {"block_m": 32, "block_n": 32}])
    kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, scale, sliding_window=window, logit_softcap=softcap,
                                    out=out, **tiles)
    assert_close(out, ref, dtype)
    out = torch.full_like(q, float("nan"))  # the split op: one-query sequences through the decode kernel
    kernels.paged_mixed_attention(q, kc, vc, bt, cu, ctx, scale, sliding_window=window, logit_softcap=softcap, out=out)
    assert_close(out, ref, dtype)
    out = torch.full_like(q[last], float("nan"))
    kernels.paged_decode_attention(q[last], kc, vc, bt, ctx, scale, sliding_window=window, logit_softcap=softcap,
                                   out=out, num_splits=pick([None, 1, 3]))
    assert_close(out, ref_dec, dtype)


def test_window_skips_blocks_when_the_context_is_long():
    # a 16-token window at the end of 300-token contexts: nearly every block is poisoned, and a
    # query block narrower than the window in prefill walks left edge, unmasked middle and diagonal
    ctx_lens, q_lens = [300, 300, 129], [1, 120, 129]
    q, kc, vc, bt, cu, ctx = make_paged(ctx_lens, q_lens, 4, 2, 64, 16, torch.float32, seed=9)
    ref = naive(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), cu.cpu(), ctx.cpu(), 0.125, window=16)
    assert poison_outside_window(kc, vc, bt, cu, ctx, 16) >= 18
    out = kernels.paged_prefill_attention(q, kc, vc, bt, cu, ctx, 0.125, sliding_window=16, block_m=64, block_n=16)
    assert_close(out, ref, torch.float32)
    rows = (cu[1:] - 1).long()
    for splits in (1, 4):
        out = kernels.paged_decode_attention(q[rows], kc, vc, bt, ctx, 0.125, sliding_window=16, num_splits=splits)
        assert_close(out, ref[rows.cpu()], torch.float32)


@pytest.mark.parametrize("bad", [{"sliding_window": 0}, {"sliding_window": -4}, {"sliding_window": 2.5},
                                 {"sliding_window": True}, {"logit_softcap": 0.0}, {"logit_softcap": -1.0},
                                 {"logit_softcap": "50"}])
def test_wrappers_and_references_reject_bad_window_or_cap(bad):
    q, kc, vc, bt, cu, ctx = make_paged([5, 9], [5, 1], 4, 2, 32, 16, torch.float32, seed=3)
    word = "sliding_window" if "sliding_window" in bad else "logit_softcap"
    for fn in (kernels.paged_prefill_attention, R.paged_prefill_attention):
        with pytest.raises(ValueError, match=word):
            fn(q, kc, vc, bt, cu, ctx, 1.0, **bad)
    for fn in (kernels.paged_decode_attention, R.paged_decode_attention):
        with pytest.raises(ValueError, match=word):
            fn(q[:2], kc, vc, bt, ctx, 1.0, **bad)


def test_soft_cap_bounds_scores():
    x = torch.tensor([-1e4, -3.0, 0.0, 1e-3, 3.0, 1e4])
    capped = R.soft_cap(x, 5.0)
    assert capped.abs().max() <= 5.0 and torch.equal(R.soft_cap(x, None), x)
    torch.testing.assert_close(capped[3], torch.tensor(1e-3), rtol=1e-5, atol=0)
    assert math.isclose(float(capped[4]), 5 * math.tanh(0.6), rel_tol=1e-6)
