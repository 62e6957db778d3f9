"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): which rows of a step's hidden states
score prompt tokens, and their log-softmax (fp32) on the device.

The hidden state at position p predicts token p + 1, so a chunk of a prompt computed over positions
[start, end) scores prompt tokens start + 1 .. min(end, num_prompt_tokens - 1). Only requests that ask
get these rows (the others keep the LM head on their last position); a prompt prefilled over several
steps reports a chunk per step, and the engine joins them. Only the first sample of a request
computes them (the others read its prompt from the prefix cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagestream.engine.sequence import Sequence

_ROWS_PER_SLICE = 1024  # rows of prompt logits turned into fp32 logprobs at a time


@dataclass(slots=True)
class PromptChunk:
    """Prompt tokens ``first .. first + len(targets) - 1`` of ``seq``, scored by one step."""

    seq: Sequence
    first: int  # index in the prompt of the first token scored (>= 1)
    targets: list[int]  # the prompt's tokens at those positions
    k: int  # how many top logprobs beside the prompt's token


def prompt_chunks(num_scheduled_tokens: dict[Sequence, int], cu_seqlens_q: np.ndarray
                  ) -> tuple[list[PromptChunk], np.ndarray]:
    """The step's chunks of prompts whose logprobs were asked for, and the token rows (of the step's
    hidden states) that score them, in chunk order: ([], empty) in the common step."""
    chunks: list[PromptChunk] = []
    rows: list[np.ndarray] = []
    for i, (seq, n) in enumerate(num_scheduled_tokens.items()):
        k = seq.params.prompt_logprobs
        if k is None or seq.sample_index:
            continue
        start = seq.num_computed_tokens
        end = min(start + n, seq.num_prompt_tokens - 1)  # the last prompt position scores an output token
        if end <= start:
            continue
        row0 = int(cu_seqlens_q[i])
        rows.append(np.arange(row0, row0 + end - start, dtype=np.int64))
        chunks.append(PromptChunk(seq, start + 1, seq.token_ids[start + 1 : end + 1], k))
    return chunks, (np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64))


@dataclass(slots=True)
class PromptLogprobs:
    """A step's prompt logprobs on their way to the host (``wait`` blocks on the copy)."""

    chunks: list[PromptChunk]
    chosen: torch.Tensor  # [num_rows] float32: logprob of each prompt token
    top_vals: torch.Tensor | None  # [num_rows, k_max] float32
    top_ids: torch.Tensor | None  # [num_rows, k_max] int64
    event: "torch.cuda.Event | None"

    def wait(self) -> list[tuple[Sequence, int, list[dict[int, float]]]]:
        """Per chunk: (sequence, index of its first prompt token, {token_id: logprob} per token)."""
        if self.event is not None:
            self.event.synchronize()
        chosen = self.chosen.tolist()
        vals = self.top_vals.tolist() if self.top_vals is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        out, r = [], 0
        for c in self.chunks:
            lps = []
            for j, tok in enumerate(c.targets):
                d = dict(zip(ids[r + j][: c.k], vals[r + j][: c.k])) if c.k and ids is not None else {}
                d[tok] = chosen[r + j]
                lps.append(d)
            r += len(c.targets)
            out.append((c.seq, c.first, lps))
        return out


def compute_prompt_logprobs(logits: torch.Tensor, chunks: list[PromptChunk]) -> PromptLogprobs:
    """log-softmax in fp32 of ``logits`` ([num_rows, vocab], the chunks' rows in order), the prompt tokens'
    entries and the top k; copied to the host without waiting."""
    device = logits.device
    targets = torch.tensor([t for c in chunks for t in c.targets], dtype=torch.long).to(device, non_blocking=True)
    k_max = max(c.k for c in chunks)
    chosen_parts, val_parts, id_parts = [], [], []
    # a long prompt chunk in slices of rows: its fp32 log-softmax is rows x vocab x 4 bytes
    for r in range(0, logits.shape[0], _ROWS_PER_SLICE):
        lp = torch.log_softmax(logits[r : r + _ROWS_PER_SLICE].float(), dim=-1)  # [rows, vocab]
        chosen_parts.append(lp.gather(1, targets[r : r + _ROWS_PER_SLICE, None])[:, 0])
        if k_max:
            vals, ids = lp.topk(k_max, dim=-1)
            val_parts.append(vals)
            id_parts.append(ids)
    chosen = torch.cat(chosen_parts)
    top_vals = torch.cat(val_parts) if k_max else None
    top_ids = torch.cat(id_parts) if k_max else None
    if device.type != "cuda":
        return PromptLogprobs(chunks, chosen, top_vals, top_ids, None)
    host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in (chosen, top_vals, top_ids)]
    event = torch.cuda.Event()
    event.record()
    return PromptLogprobs(chunks, host[0], host[1], host[2], event)
