"""Pure torch references for every kernel in this package.

The engine runs these on the CPU (and with PAGESTREAM_KERNELS=torch); the tests
check the Triton kernels against them, and the references themselves against a
naive dense attention. They are vectorised within a sequence (attention loops
over sequences in python only for prefill), so the engine's CPU tests stay fast.

Cache layout, shared with the Triton kernels:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagestream.kernels._checks import check_window_and_softcap

__all__ = [
    "store_kvcache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "compute_cos_sin_cache",
    "soft_cap",
]


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = skip
) -> None:
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    # One index_copy_ over the flattened slots: much cheaper on the CPU than a 2-D index_put_.
    for src, cache in ((key, k_cache), (value, v_cache)):
        if cache.is_contiguous():
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, src.to(cache.dtype))
        else:
            cache[slots // cache.shape[1], slots % cache.shape[1]] = src.to(cache.dtype)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    # cache: [num_blocks, block_size, kvh, d]; blocks: any shape of block ids -> [*blocks.shape, block_size, kvh, d]
    # index_select over flattened blocks copies whole blocks, ~3x faster on the CPU than advanced indexing.
    flat = cache.reshape(cache.shape[0], -1).index_select(0, blocks.reshape(-1).to(torch.long))
    return flat.view(*blocks.shape, *cache.shape[1:])


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, kvh, d]; block_table: [max_blocks] -> [num_tokens, kvh, d]
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    blocks = _gather_blocks(cache, block_table[:num_blocks])
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:num_tokens]


def _check_gqa(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap), as Gemma 2 applies it to attention scores and final logits."""
    return x if cap is None else torch.tanh(x / cap) * cap


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in cache incl. the current one
    scale: float,
    sliding_window: int | None = None,  # the query sees its last `sliding_window` tokens, itself included
    logit_softcap: float | None = None,  # scores -> cap * tanh(scores / cap) before the softmax
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    num_blocks_total, block_size, num_kv_heads, _ = k_cache.shape
    _check_gqa(num_heads, num_kv_heads)
    check_window_and_softcap(sliding_window, logit_softcap)
    if num_seqs == 0:
        return torch.empty_like(q)
    max_len = int(context_lens.max())
    nb = (max_len + block_size - 1) // block_size
    # Entries past a sequence's last block may be garbage: clamp, then mask.
    blocks = block_tables[:, :nb].to(torch.long).clamp(0, num_blocks_total - 1)
    k = _gather_blocks(k_cache, blocks).view(num_seqs, nb * block_size, num_kv_heads, head_dim)
    v = _gather_blocks(v_cache, blocks).view(num_seqs, nb * block_size, num_kv_heads, head_dim)
    pos = torch.arange(nb * block_size, device=q.device)
    ctx = context_lens.to(q.device, torch.long)[:, None]
    mask = pos[None, :] < ctx  # [S, T]
    if sliding_window is not None:
        mask &= pos[None, :] >= ctx - sliding_window
    group = num_heads // num_kv_heads
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    # Slots past a context may hold anything (NaN from torch.empty): a zero weight times NaN is NaN, so K and V
    # (fresh gathered copies) are zeroed there, as whole rows (index_fill_: ~10x cheaper on the CPU than a
    # masked_fill_ with a broadcast mask), and the scores there are masked out.
    outside = (~mask).reshape(-1).nonzero().squeeze(1)
    k, v = k.float(), v.float()
    for t in (k, v):
        t.view(num_seqs * nb * block_size, -1).index_fill_(0, outside, 0.0)
    if logit_softcap is None:
        # one fused SDPA call: a kv head's group of query heads are its queries ([S, kvh, group, d] against
        # [S, kvh, T, d]), ~4x faster on the CPU than the einsums below
        out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
                                             scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
    scores = soft_cap(torch.einsum("skgd,stkd->skgt", qg, k) * scale, logit_softcap)  # [S, kvh, group, T]
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    out = torch.einsum("skgt,stkd->skgd", scores.softmax(dim=-1), v)  # [S, kvh, group, d]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in cache incl. the new ones
    scale: float,
    max_seqlen_q: int | None = None,  # unused here; the Triton kernel takes it for its grid
    sliding_window: int | None = None,  # a query sees its last `sliding_window` tokens, itself included
    logit_softcap: float | None = None,  # scores -> cap * tanh(scores / cap) before the softmax
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = q.shape
    num_blocks_total, block_size, num_kv_heads, _ = k_cache.shape
    _check_gqa(num_heads, num_kv_heads)
    check_window_and_softcap(sliding_window, logit_softcap)
    out = torch.empty_like(q)
    _prefill_into(out, q, k_cache, v_cache, block_tables, cu_seqlens_q.tolist(), context_lens.tolist(), scale,
                  sliding_window, logit_softcap, range(len(context_lens)))
    return out


def _prefill_into(out, q, k_cache, v_cache, block_tables, cu: list[int], ctx: list[int], scale: float,
                  sliding_window: int | None, logit_softcap: float | None, seqs) -> None:
    """paged_prefill_attention's rows of the sequences ``seqs``, written into ``out``."""
    num_heads, num_kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    for i in seqs:
        start, end = cu[i], cu[i + 1]
        q_len, ctx_len = end - start, ctx[i]
        if q_len == 0:
            continue
        if q_len > ctx_len:
            raise ValueError(f"sequence {i}: {q_len} queries but only {ctx_len} context tokens")
        # Blocks wholly left of the first query's window are never read.
        first_block = 0 if sliding_window is None else max(0, ctx_len - q_len - sliding_window + 1) // block_size
        kv_start = first_block * block_size
        k = _gather_kv(k_cache, block_tables[i, first_block:], ctx_len - kv_start).transpose(0, 1).float()  # [kvh, T, d]
        v = _gather_kv(v_cache, block_tables[i, first_block:], ctx_len - kv_start).transpose(0, 1).float()
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        kv_pos = torch.arange(kv_start, ctx_len, device=q.device)
        mask = kv_pos[None, :] <= q_pos[:, None]  # [q_len, T]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        qi = q[start:end].transpose(0, 1).float()  # [H, q_len, d]
        if logit_softcap is None:
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            group = num_heads // num_kv_heads
            scores = soft_cap(qi @ k.repeat_interleave(group, 0).transpose(1, 2) * scale, logit_softcap)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.repeat_interleave(group, 0)
        out[start:end] = o.transpose(0, 1).to(q.dtype)  # o: [H, q_len, d]


def paged_mixed_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in cache incl. the new ones
    scale: float,
    max_seqlen_q: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """A step that mixes decode sequences (one query each) with prefill chunks: the same function of its
    inputs as paged_prefill_attention, with the one-query sequences batched through paged_decode_attention
    (as the Triton op splits it) instead of attended one by one."""
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    single = [i for i in range(len(ctx)) if cu[i + 1] - cu[i] == 1]
    if len(single) < 2:
        return paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                       max_seqlen_q, sliding_window, logit_softcap)
    _check_gqa(q.shape[1], k_cache.shape[2])
    check_window_and_softcap(sliding_window, logit_softcap)
    out = torch.empty_like(q)
    seqs = torch.tensor(single, device=q.device)
    rows = torch.tensor([cu[i] for i in single], device=q.device)
    out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, block_tables[seqs], context_lens[seqs], scale,
                                       sliding_window, logit_softcap)
    chosen = set(single)
    _prefill_into(out, q, k_cache, v_cache, block_tables, cu, ctx, scale, sliding_window, logit_softcap,
                  [i for i in range(len(ctx)) if i not in chosen])
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, V] -> [rows] int64, the first index of each row's max
    return x.argmax(dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # HF Llama: the residual add happens in the activation dtype, the norm in fp32.
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, x)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] fp32: cos | sin
) -> tuple[torch.Tensor, torch.Tensor]:
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    cs = cos_sin_cache[positions.to(torch.long)]  # [num_tokens, rotary_dim]
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        # As HF: cos/sin cast to the activation dtype, math in that dtype.
        xr, xpass = x[..., :rotary_dim], x[..., rotary_dim:]
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat([-x2, x1], dim=-1)
        out = xr * cos.to(x.dtype) + rot * sin.to(x.dtype)
        return out if xpass.shape[-1] == 0 else torch.cat([out, xpass], dim=-1)

    return rotate(q), rotate(k)


def compute_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # [max_position, head_dim] fp32: cos | sin
    """cos/sin table as transformers builds it (default and "llama3" rope types)."""
    dim = head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    rope_type = "default"
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "llama3":
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported; allowed: 'default', 'llama3'")
    positions = torch.arange(max_position, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
