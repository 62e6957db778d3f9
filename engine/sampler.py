"""Turns logits into tokens: penalties, min_tokens, greedy or temperature/top-k/top-p/min-p,
per-request seeds, logprobs. Nothing here waits for the device: the sampled ids (and logprobs)
go to pinned host memory behind an event, the step's one host transfer."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from pagestream.engine.layers.ops import kernel_ops
from pagestream.engine.sequence import Sequence


def seeded_draw_seed(seed: int, sample_index: int, token_index: int) -> int:
    """The RNG seed for one draw: depends on nothing but (seed, sample, position),
    so a request samples the same alone, in any batch, or resumed on another worker."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}:{token_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # per row: None, or (logprob of the sampled token, {token_id: logprob} of the top-k)
    logprobs: list[tuple[float, dict[int, float]] | None]


@dataclass(slots=True)
class HostSample:
    """Sampled ids (and logprobs) on their way to pinned host memory; ``wait`` blocks
    on the copy's event, the step's one device-to-host synchronisation."""

    token_ids: torch.Tensor  # [n] int64, host
    logprob_k: list[int | None]  # per row: None, or how many top logprobs it asked for
    chosen: torch.Tensor | None  # [n] float32, host: logprob of the sampled token
    top_vals: torch.Tensor | None  # [n, k_max] float32, host
    top_ids: torch.Tensor | None  # [n, k_max] int64, host
    event: "torch.cuda.Event | None"

    def wait(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()
        token_ids = self.token_ids.tolist()
        logprobs: list[tuple[float, dict[int, float]] | None] = [None] * len(token_ids)
        if self.chosen is not None:
            chosen, vals, ids = self.chosen.tolist(), self.top_vals.tolist(), self.top_ids.tolist()
            for i, k in enumerate(self.logprob_k):
                if k is None:
                    continue
                top = dict(zip(ids[i][:k], vals[i][:k]))
                top[token_ids[i]] = chosen[i]
                logprobs[i] = (chosen[i], top)
        return SamplerOutput(token_ids, logprobs)


@dataclass(slots=True)
class DeviceSample:
    """What the sampler leaves on the device for one step."""

    token_ids: torch.Tensor  # [n] int64
    logprob_k: list[int | None]
    chosen: torch.Tensor | None = None  # [n] float32
    top_vals: torch.Tensor | None = None  # [n, k_max] float32
    top_ids: torch.Tensor | None = None  # [n, k_max] int64

    def to_host(self) -> HostSample:
        """Start the copies to pinned memory (no wait) and mark their end with an event."""
        tensors = [self.token_ids, self.chosen, self.top_vals, self.top_ids]
        if self.token_ids.device.type != "cuda":
            return HostSample(*tensors[:1], self.logprob_k, *tensors[1:], None)
        host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in tensors]
        event = torch.cuda.Event()
        event.record()
        return HostSample(host[0], self.logprob_k, host[1], host[2], host[3], event)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int], seed: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._seeded = torch.Generator(device=device)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 grammar_bitmask: tuple[torch.Tensor, list[int]] | None = None) -> DeviceSample:
        """Sample one token per row without waiting for the device.

        A sequence's next output index is ``num_planned_output_tokens`` (its token
        from the step still in flight counts). Penalties read the token history on
        the host, so the engine runs steps with penalised sequences synchronously.

        ``grammar_bitmask`` (structured outputs, from ``ModelRunner.grammar_rows``): (bitmask
        [num_seqs, words] int32, the rows it constrains); those rows' forbidden tokens get -inf before any other sampler step, so
        temperature, top-k/p, min-p, penalties and seeds all draw from the allowed tokens.
        Logprobs report the model's distribution before the mask (as vLLM's raw logprobs).
        """
        # logits: [num_seqs, vocab] float32 (the model's raw output for each row's last position)
        masked = grammar_bitmask is not None and bool(grammar_bitmask[1])
        if self._plain_greedy(seqs):
            if masked:
                logits = logits[:, : self.vocab_size].float()
                self._apply_grammar(logits, grammar_bitmask)
            return DeviceSample(self.greedy(logits), [None] * len(seqs))
        params = [s.params for s in seqs]
        logprob_k = [p.logprobs for p in params]
        want_logprobs = any(k is not None for k in logprob_k)
        logits = logits[:, : self.vocab_size].float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if masked:
            logits = logits.clone() if want_logprobs else logits
            self._apply_grammar(logits, grammar_bitmask)

        if any(p.biases_logits for p in params):
            logits = self._apply_logit_bias(logits.clone(), seqs)
        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits.clone(), seqs)
        logits = self._apply_min_tokens(logits, seqs)

        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, seqs, greedy)
        out = DeviceSample(tokens, logprob_k)
        if want_logprobs:
            k_max = max(1, max(k for k in logprob_k if k is not None))
            out.chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
            out.top_vals, out.top_ids = raw_logprobs.topk(k_max, dim=-1)
        return out

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:  # [n, vocab (padded)] -> [n] int64
        """The all-greedy batch's tokens: argmax in the model's dtype picks the same token as in fp32
        (the conversion is exact and keeps order), without an fp32 copy of every row's logits."""
        return kernel_ops(logits.device).argmax(logits[:, : self.vocab_size])

    def _apply_grammar(self, logits: torch.Tensor, grammar_bitmask: tuple[torch.Tensor, list[int]]) -> None:
        from pagestream.engine.structured_output.bitmask import apply_bitmask

        bitmask, rows = grammar_bitmask
        apply_bitmask(logits, bitmask, rows, self.vocab_size)

    @staticmethod
    def _plain_greedy(seqs: list[Sequence]) -> bool:
        """Every row greedy, without logprobs, penalties or a min_tokens ban in force. Runs for
        every sampled sequence every step: a request's samples (often a whole batch) share one
        SamplingParams, checked once per run of equal ones."""
        checked = None
        for s in seqs:
            p = s.params
            if p is not checked:
                if p.logprobs is not None or not p.greedy or p.uses_penalties or p.biases_logits:
                    return False
                checked = p
            if p.min_tokens and len(s.token_ids) + s.num_pending_tokens - s.num_prompt_tokens < p.min_tokens:
                return False
        return True

    def _apply_logit_bias(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``allowed_token_ids`` (every other token -inf), then ``logit_bias`` added, as vLLM orders them:
        after a grammar's mask, before penalties, min_tokens and temperature."""
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.allowed_token_ids is not None:
                keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], device=logits.device, dtype=torch.long)
                row = torch.full_like(logits[i], float("-inf"))
                row[keep] = logits[i, keep]
                logits[i] = row
            if p.logit_bias:
                ids = [t for t in p.logit_bias if t < vocab]
                logits[i, ids] += torch.tensor([p.logit_bias[t] for t in ids], device=logits.device, dtype=logits.dtype)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            p = seq.params
            if not p.uses_penalties:
                continue
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device, dtype=torch.long)
                seen = seen[seen < vocab]
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out = torch.tensor(seq.output_token_ids, device=logits.device, dtype=torch.long)
                if out.numel():
                    counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
                    logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows, cols = [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.num_planned_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids or [])
                if not p.ignore_eos:
                    banned |= self.eos_token_ids
                for t in banned:
                    if t < logits.shape[1]:
                        rows.append(i)
                        cols.append(t)
        if rows:
            logits = logits.clone()
            logits[rows, cols] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        """Greedy rows take the argmax; only the sampling rows pay for temperature, top-k/p, min-p and noise
        (a vocabulary's worth of exponential draws a row: on the CPU most of a small model's step)."""
        dev = logits.device
        rows = [i for i, g in enumerate(greedy) if not g]
        params = [seqs[i].params for i in rows]
        mixed = len(rows) < len(seqs)  # greedy rows too: only then the sampling rows are picked out (a copy)
        row_index = torch.tensor(rows, device=dev) if mixed else None
        x = logits.index_select(0, row_index) if mixed else logits
        m, vocab = x.shape
        x = x / torch.tensor([p.temperature for p in params], device=dev)[:, None]

        top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(tp < 1.0 for tp in top_p):
            sorted_x, sorted_idx = x.sort(dim=-1, descending=True)
            ks = torch.tensor(top_k, device=dev)
            sorted_x = sorted_x.masked_fill(torch.arange(vocab, device=dev)[None, :] >= ks[:, None], float("-inf"))
            ps = torch.tensor(top_p, device=dev)
            probs_sorted = sorted_x.softmax(dim=-1)
            # drop a token once the mass before it already reaches top_p (the first always stays)
            drop = (probs_sorted.cumsum(dim=-1) - probs_sorted) >= ps[:, None]
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.empty_like(x).scatter_(-1, sorted_idx, sorted_x)
        min_p = [p.min_p for p in params]
        if any(mp > 0 for mp in min_p):
            probs = x.softmax(dim=-1)
            thresh = torch.tensor(min_p, device=dev)[:, None] * probs.max(dim=-1, keepdim=True).values
            x = x.masked_fill(probs < thresh, float("-inf"))
        probs = x.softmax(dim=-1)

        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) samples from p. A seeded row draws
        # from its own (seed, sample, position) stream; the others from the engine's generator.
        noise = torch.empty_like(probs)
        unseeded = [j for j, p in enumerate(params) if p.seed is None]
        if len(unseeded) == m:
            noise.exponential_(generator=self.generator)
        elif unseeded:
            noise[unseeded] = torch.empty((len(unseeded), vocab), device=dev).exponential_(generator=self.generator)
        for j, p in enumerate(params):
            if p.seed is not None:
                seq = seqs[rows[j]]
                self._seeded.manual_seed(seeded_draw_seed(p.seed, seq.sample_index, seq.num_planned_output_tokens))
                noise[j].exponential_(generator=self._seeded)
        sampled = (probs / noise).argmax(dim=-1)
        return logits.argmax(dim=-1).index_copy_(0, row_index, sampled) if mixed else sampled
