"""Owns every device tensor: weights, the KV pool, step inputs. Takes a
SchedulerOutput, returns sampled token ids."""
from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from pagestream.engine.config import EngineConfig
from pagestream.engine.input_batch import InputBatch
from pagestream.engine.layers.attention import AttentionMetadata
from pagestream.engine.loader import build_model
from pagestream.engine.parallel_state import TPGroup, tensor_parallel
from pagestream.engine.prompt_logprobs import PromptChunk, PromptLogprobs, compute_prompt_logprobs, prompt_chunks
from pagestream.engine.rank_executor import TensorParallelDriver, unpack_step
from pagestream.engine.sampler import HostSample, Sampler, SamplerOutput
from pagestream.engine.scheduler import SchedulerOutput
from pagestream.engine.sequence import Sequence
from pagestream.kernels.reference import compute_cos_sin_cache

logger = logging.getLogger(__name__)


_ALIGN = 16  # elements: 64 bytes of int32, 128 of int64


def _packed(dtype: torch.dtype, pin: bool, *parts: np.ndarray | list[int] | int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One host buffer holding ``parts`` (arrays or lists of ints, or an int: that many zeros), each
    segment aligned; returns the buffer and a view per part."""
    sizes = [p if isinstance(p, int) else len(p) for p in parts]
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    buf = torch.zeros(total, dtype=dtype, pin_memory=pin)
    arr = buf.numpy()
    views = []
    for part, start, n in zip(parts, starts, sizes):
        if not isinstance(part, int) and n:
            arr[start : start + n] = part
        views.append(buf[start : start + n])
    return buf, views


def _spread(num_tokens: int, num_seqs: int) -> list[int]:
    """``num_tokens`` query tokens over ``num_seqs`` sequences, as evenly as possible (each >= 1
    when num_tokens >= num_seqs): the layout of the throw-away steps at start-up."""
    q_len, extra = divmod(num_tokens, num_seqs)
    return [q_len + 1] * extra + [q_len] * (num_seqs - extra)


def batch_buckets(max_size: int) -> list[int]:
    """Batch sizes a step is padded up to: the decode graphs' sizes, and the LM head's row counts."""
    return sorted({s for s in [1, 2, 4, 8, *range(16, max_size + 1, 16), max_size] if s <= max_size})


def _same_views(dst: torch.Tensor, src: torch.Tensor, *views: torch.Tensor) -> list[torch.Tensor]:
    """The views of ``src`` carried over to ``dst``, a copy of it (same offsets and sizes)."""
    base = src.data_ptr()
    item = src.element_size()
    return [dst[(v.data_ptr() - base) // item :][: v.numel()] for v in views]


@dataclass(slots=True)
class StepInputs:
    """One step's device inputs, as ``ModelRunner.prepare`` lays them out."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    # [num_sample, or its bucket] int64: rows of the hidden states the LM head runs on; the first
    # len(sample_seqs) are sampled, the rest repeat the last (ModelRunner.sample_buckets)
    sample_rows: torch.Tensor
    sample_seqs: list[Sequence]
    # prompts whose logprobs this step scores: their rows follow the sampled ones in ``sample_rows``
    prompt_chunks: list[PromptChunk] | None = None


@dataclass(slots=True)
class StepHandle:
    """A launched step. ``seqs`` sampled one token each, row i of ``token_ids`` (on the
    device, where the next step may read them); ``result()`` waits for the host copy."""

    seqs: list[Sequence]
    rows: dict[Sequence, int]
    token_ids: torch.Tensor | None  # [len(seqs)] int64 on the device
    host: "HostSample | None"
    prompt_logprobs: PromptLogprobs | None = None  # the prompt chunks this step scored (those that asked)
    sampled: SamplerOutput | None = None  # result(), once read

    def result(self) -> SamplerOutput:
        """Wait for the host copy (once: the next step's mask may have read it already)."""
        if self.sampled is None:
            self.sampled = SamplerOutput([], []) if self.host is None else self.host.wait()
        return self.sampled

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str, rank: int = 0, tensor_parallel_size: int = 1) -> torch.device:
    """The device of ``rank``: with tensor parallelism on CUDA, rank r runs on cuda:r."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    device = torch.device(name)
    if device.type == "cuda" and tensor_parallel_size > 1:
        if torch.cuda.device_count() < tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs that many GPUs, "
                             f"torch sees {torch.cuda.device_count()}")
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    return device


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    ckpt = config.hf_config.get("torch_dtype") or config.hf_config.get("dtype") or "bfloat16"
    dtype = _DTYPES.get(str(ckpt).replace("torch.", ""), torch.bfloat16)
    return torch.bfloat16 if dtype == torch.float32 else dtype


class ModelRunner:
    """One rank's runner. ``tp`` is given on ranks 1..N-1 (spawned by rank 0, see
    engine/rank_executor.py); the engine's runner leaves it None and, at tensor_parallel_size > 1,
    is rank 0: it starts the other ranks and ships them every step."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int], tp: TPGroup | None = None) -> None:
        self.config = config
        tp_size = config.tensor_parallel_size
        self.device = resolve_device(config.device, tp.rank if tp is not None else 0, tp_size)
        self.dtype = resolve_dtype(config, self.device)
        self.block_size = config.block_size
        self.driver: TensorParallelDriver | None = None
        if tp is None:
            if self.device.type == "cuda":  # refuse a model too big for its GPUs before starting anything
                from pagestream.engine.memory import check_weights_fit

                check_weights_fit(config.hf_config, self.dtype, tp_size,
                                  torch.cuda.get_device_properties(self.device).total_memory, config.gpu_memory_utilization)
            tp = TPGroup()
            if tp_size > 1:
                self.driver = TensorParallelDriver(config, self.device, rank_runner)
                weakref.finalize(self, self.driver.shutdown)
                tp = self.driver.tp
        self.tp = tp
        try:
            with self._tp_guard():
                self._build(config, eos_token_ids)
        except BaseException:
            self.shutdown()
            raise

    def _tp_guard(self):
        """Around work with collectives on rank 0: a rank that died surfaces as EngineDeadError."""
        return self.driver.guard() if self.driver is not None else contextlib.nullcontext()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at size 1)."""
        if self.driver is not None:
            # graphs that captured collectives go before the communicator they use
            for name in ("graphs", "mixed_graphs"):
                if isinstance(getattr(self, name, None), dict):
                    getattr(self, name).clear()
            self.driver.shutdown()

    def _build(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        torch.manual_seed(config.seed)
        with tensor_parallel(self.tp):  # every layer built here holds this rank's shard
            self.model = build_model(config.hf_config, self.dtype, self.device, config.load_format, config.model,
                                     config.seed)
        self.vocab_size = int(config.hf_config["vocab_size"])
        self.num_layers = len(self.model.attention_layers())
        self.num_kv_heads = self.model.num_kv_heads
        self.head_dim = self.model.head_dim
        self.cos_sin_cache = compute_cos_sin_cache(
            self.head_dim, config.max_model_len, self.model.rope_theta, self.model.rope_scaling, self.device
        )  # [max_model_len, head_dim] fp32
        self.num_blocks = self._num_kv_blocks()
        if self.tp.size > 1:  # one block table for all ranks: the pool is as large as the tightest card allows
            n = torch.tensor([self.num_blocks], dtype=torch.long, device=self.device)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN, group=self.tp.group)
            self.num_blocks = int(n.item())
        # [2, num_layers, num_blocks, block_size, num_kv_heads (this rank's), head_dim]
        self.kv_cache = torch.empty(
            2, self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
            dtype=self.dtype, device=self.device,
        )
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]
        self.sampler = Sampler(self.vocab_size, eos_token_ids, config.seed, self.device)
        # structured outputs (set by LLMEngine): (sampled seqs, the step still in flight) -> the step's
        # (bitmask, constrained rows), or None when no row is constrained. Called between the LM head
        # and the sampler, so the host fills the mask while the device runs the forward pass.
        self.grammar_rows = None
        self.input_batch = InputBatch(config.max_num_seqs, -(-config.max_model_len // self.block_size), self.block_size)
        # On CUDA the LM head runs on a bucketed number of rows, each bucket warmed at start-up: cuBLAS
        # sets up each new matmul shape on first use, 4-5 ms on the H200 (bench/decode_probe.py), which
        # a batch's last steps paid once for every count of samples still running.
        self.sample_buckets = batch_buckets(config.max_num_seqs) if self.device.type == "cuda" else []
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_decode_graphs()

    # ---- sizing --------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type == "cpu":
            budget = cfg.kv_cache_bytes
        else:
            budget = self._profile_free_bytes()
        num = budget // self.bytes_per_block
        if num < 1:
            raise ValueError(
                f"no room for a single KV block ({self.bytes_per_block} bytes) in a budget of {budget} bytes; "
                "raise gpu_memory_utilization / kv_cache_bytes"
            )
        return int(num)

    def _profile_free_bytes(self) -> int:
        """Memory left for the KV pool after weights and a full-budget forward pass."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        cfg = self.config
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len * cfg.max_num_seqs)
        seq_len = min(num_tokens, cfg.max_model_len)
        num_seqs = max(1, num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        tmp = torch.empty(2, num_seqs * blocks_per_seq, self.block_size, self.num_kv_heads, self.head_dim,
                          dtype=self.dtype, device=self.device)
        for attn in self.model.attention_layers():
            attn.k_cache, attn.v_cache = tmp[0], tmp[1]
        ids = torch.zeros(num_seqs * seq_len, dtype=torch.long, device=self.device)
        pos = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_seqs * seq_len, device=self.device).view(num_seqs, seq_len)
            + (torch.arange(num_seqs, device=self.device) * (blocks_per_seq * self.block_size - seq_len))[:, None],
            block_tables=torch.arange(num_seqs * blocks_per_seq, device=self.device, dtype=torch.int32).view(num_seqs, -1),
            context_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32, device=self.device),
            max_seqlen_q=seq_len,
            decode_only=False,
        )
        meta.slot_mapping = meta.slot_mapping.reshape(-1)
        with torch.inference_mode():
            hidden = self.model(ids, pos, meta, self.cos_sin_cache)
            self.model.compute_logits(hidden[-min(num_tokens, cfg.max_num_seqs):]).float()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del tmp, hidden
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free, _ = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * cfg.gpu_memory_utilization) - peak - max(used_by_others, 0)
        logger.info("KV budget %.2f GiB (peak %.2f GiB)", budget / 2**30, peak / 2**30)
        return budget

    # ---- CUDA graphs for decode ------------------------------------------------------
    @torch.inference_mode()
    def _capture_decode_graphs(self) -> None:
        """Capture CUDA graphs: one decode forward per batch-size bucket, and one mixed
        (prefill + decode) forward per token-count bucket; a step pads up to its bucket.

        Padded rows store nothing (slot -1). Padded decode rows attend to one token of
        block 0; padded sequences of a mixed step have no query tokens, and its padded
        tokens belong to none. Their outputs are never read.
        """
        cfg = self.config
        max_bs = min(cfg.max_num_seqs, 512)
        sizes = batch_buckets(max_bs)
        budget = cfg.max_num_batched_tokens
        # Token-count buckets for mixed steps, finer where padding would cost most (small steps
        # are weight-bound; a padded token is compute, and up to 2x at power-of-two buckets).
        steps = [(1024, 128), (2048, 256), (4096, 512), (8192, 1024), (budget, 2048)]
        mixed, t = [], 0
        for limit, stride in steps:
            while t + stride <= min(limit, budget):
                t += stride
                mixed.append(t)
        # a bucket must fit max_bs sequences of at most max_model_len - 1 tokens each
        mixed = sorted({m for m in [*mixed, budget] if max_bs < m <= max_bs * (cfg.max_model_len - 1)})
        max_tokens = max([max_bs, *mixed])
        max_blocks = -(-cfg.max_model_len // self.block_size)
        dev = self.device
        self.g_input_ids = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self.g_positions = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self.g_slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=dev)
        self.g_context_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.g_block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev)
        self.g_cu_seqlens = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.g_arange = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.pool = None
        for bs in reversed(sizes):  # decode specialises on batch size (its split count): warm each
            self.graphs[bs] = self._capture(bs, bs, decode_only=True, warm=True)
        self.graph_sizes = sizes
        self.mixed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mixed_sizes: list[int] = []
        self.mixed_max_seqs = max_bs
        try:
            for i, t in enumerate(reversed(mixed)):
                self.mixed_graphs[t] = self._capture(t, max_bs, decode_only=False, warm=i == 0)
            self.mixed_sizes = mixed
        except RuntimeError:  # a forward that cannot be captured: mixed steps run eagerly
            logger.warning("mixed prefill/decode steps cannot be captured; they run eagerly", exc_info=True)
            self.mixed_graphs = {}
        torch.cuda.synchronize(dev)
        logger.info("captured CUDA graphs: decode batch sizes %s, mixed token counts %s", sizes, self.mixed_sizes)

    def _capture(self, num_tokens: int, num_seqs: int, decode_only: bool, warm: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Capture-time layout (the graph reads whatever the buffers hold at replay): decode
        # rows of one token each; a mixed step's tokens spread over its sequences.
        lens = _spread(num_tokens, num_seqs)
        self.g_context_lens[:num_seqs].copy_(torch.tensor(lens, dtype=torch.int32))
        self.g_cu_seqlens[: num_seqs + 1].copy_(torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32))
        meta = AttentionMetadata(
            slot_mapping=self.g_slot_mapping[:num_tokens], block_tables=self.g_block_tables[:num_seqs],
            context_lens=self.g_context_lens[:num_seqs], cu_seqlens_q=self.g_cu_seqlens[: num_seqs + 1],
            max_seqlen_q=1 if decode_only else num_tokens, decode_only=decode_only,
        )
        args = (self.g_input_ids[:num_tokens], self.g_positions[:num_tokens], meta, self.cos_sin_cache)
        if warm:  # compile the kernels (no size specialisations: once per kind) and set up cuBLAS outside the capture
            self.model(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(*args)  # [num_tokens, hidden]
        self.pool = graph.pool() if self.pool is None else self.pool
        return graph, hidden

    def _replay(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor | None:
        """Run the step through a captured graph when one fits; None: run it eagerly."""
        n = input_ids.shape[0]
        n_seq, width = meta.block_tables.shape
        if meta.decode_only and n <= self.graph_sizes[-1]:
            bs = next(s for s in self.graph_sizes if s >= n)
            graph, hidden = self.graphs[bs]
            self.g_context_lens[n:bs].fill_(1)
            self.g_slot_mapping[n:bs].fill_(-1)
            self.g_cu_seqlens[n + 1 : bs + 1].copy_(self.g_arange[n + 1 : bs + 1])
        elif self.mixed_sizes and n <= self.mixed_sizes[-1] and n_seq <= self.mixed_max_seqs:
            t = next(s for s in self.mixed_sizes if s >= n)
            graph, hidden = self.mixed_graphs[t]
            bs = self.mixed_max_seqs
            self.g_slot_mapping[n:t].fill_(-1)
            self.g_positions[n:t].zero_()
            self.g_context_lens[n_seq:bs].fill_(1)
            self.g_cu_seqlens[n_seq + 1 : bs + 1].fill_(n)
        else:
            return None
        self.g_input_ids[:n].copy_(input_ids)
        self.g_positions[:n].copy_(positions)
        self.g_slot_mapping[:n].copy_(meta.slot_mapping)
        self.g_context_lens[:n_seq].copy_(meta.context_lens)
        self.g_cu_seqlens[: n_seq + 1].copy_(meta.cu_seqlens_q)
        self.g_block_tables[:n_seq, :width].copy_(meta.block_tables)
        graph.replay()
        return hidden[:n]

    # ---- the step ---------------------------------------------------------------
    def release_rows(self, seqs: list[Sequence]) -> None:
        """Sequences that left the running set (the scheduler's ``SchedulerOutput.left``) give
        back their rows of the persistent batch."""
        self.input_batch.release(seqs)

    def prepare(self, sched: SchedulerOutput, prev: "StepHandle | None" = None) -> StepInputs:
        """Lay the step out (``InputBatch``) in two pinned host buffers and send each with one async copy.

        A decode row whose input token was sampled by ``prev`` (still in flight: the
        host does not know it yet) takes it from ``prev``'s device tensor instead.
        """
        lay = self.input_batch.layout(sched.num_scheduled_tokens, prev.rows if prev is not None else {})
        n_seq, width = lay.block_tables.shape
        sample_rows = lay.sample_rows
        chunks, prompt_rows = prompt_chunks(sched.num_scheduled_tokens, lay.cu_seqlens_q)
        if chunks:  # the LM head runs on them too, after the sampled rows
            sample_rows = np.concatenate([sample_rows, prompt_rows])
        if self.sample_buckets and len(sample_rows):
            n = len(sample_rows)
            bucket = next((b for b in self.sample_buckets if b >= n), n)
            if bucket > n:
                sample_rows = np.concatenate([sample_rows, np.full(bucket - n, sample_rows[-1], dtype=np.int64)])
        pin = self.device.type == "cuda"
        # Each segment starts on a 64-byte boundary: Triton specialises kernels on 16-byte
        # pointer alignment, so a misaligned view would compile (and run) another variant.
        longs, (ids, pos, slots, rows, dst, src) = _packed(
            torch.long, pin, lay.input_ids, lay.positions, lay.slot_mapping, sample_rows, lay.gather_dst,
            lay.gather_src)
        ints, (ctx, cu, bt) = _packed(torch.int32, pin, lay.context_lens, lay.cu_seqlens_q, n_seq * width)
        bt.numpy().reshape(n_seq, width)[:] = lay.block_tables
        if pin:
            dev_longs = longs.to(self.device, non_blocking=True)
            dev_ints = ints.to(self.device, non_blocking=True)
            ids, pos, slots, rows, dst, src = _same_views(dev_longs, longs, ids, pos, slots, rows, dst, src)
            ctx, cu, bt = _same_views(dev_ints, ints, ctx, cu, bt)
        if lay.gather_dst.size:
            ids[dst] = prev.token_ids[src]
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=bt.view(n_seq, width),
            context_lens=ctx,
            cu_seqlens_q=cu,
            max_seqlen_q=lay.max_seqlen_q,
            decode_only=lay.max_seqlen_q == 1,
            has_single_query_seqs=lay.has_single_query_seqs,
        )
        return StepInputs(ids, pos, meta, rows, lay.sample_seqs, chunks or None)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, prev: "StepHandle | None" = None) -> "StepHandle":
        """Launch one forward pass and the sampling of the sequences that caught up.

        Returns at once with the step in flight: its sampled ids stay on the device
        (the next step may read them) and travel to pinned host memory behind an
        event; ``StepHandle.result()`` waits for them.
        """
        inp = self.prepare(sched, prev)
        if self.driver is None:
            return self._launch(inp, prev)
        # Tensor parallel: the other ranks run this step from a copy of its input buffers, taken
        # after prepare() wrote the tokens still on the device (async scheduling) into them, so only
        # rank 0 samples and the others never need the sampled ids: one broadcast per step carries
        # both. (Sampling on every rank from gathered logits would need each rank to hold every
        # request's sampling state, and any drift between ranks would corrupt the KV caches silently.)
        self.driver.publish(inp)
        with self.driver.guard():
            handle = self._launch(inp, prev)
        if handle.host is not None:  # waiting for the ids must notice a dead rank rather than hang
            handle.host.event = self.driver.watch(handle.host.event)
        return handle

    def _launch(self, inp: StepInputs, prev: "StepHandle | None" = None) -> "StepHandle":
        hidden = self._forward(inp)
        if not inp.sample_seqs and not inp.prompt_chunks:
            return StepHandle([], {}, None, None)
        # [num_sample (+ prompt rows), vocab]: the rows past those only pad the matmul to its bucket
        all_logits = self.model.compute_logits(hidden.index_select(0, inp.sample_rows))
        num_sample = len(inp.sample_seqs)
        prompt_lps = None
        if inp.prompt_chunks:
            num_rows = sum(len(c.targets) for c in inp.prompt_chunks)
            prompt_lps = compute_prompt_logprobs(all_logits[num_sample : num_sample + num_rows], inp.prompt_chunks)
        if not num_sample:
            return StepHandle([], {}, None, None, prompt_lps)
        logits = all_logits[:num_sample]
        # Structured outputs: only the sampler needs the mask. The forward pass and LM head are queued
        # already; grammar_rows waits for prev's tokens (the matchers need them) while the device runs
        # this step's forward, then fills the mask on the host.
        mask = self.grammar_rows(inp.sample_seqs, prev) if self.grammar_rows is not None else None
        sampled = self.sampler(logits, inp.sample_seqs) if mask is None else self.sampler(logits, inp.sample_seqs, mask)
        return StepHandle(inp.sample_seqs, {s: i for i, s in enumerate(inp.sample_seqs)}, sampled.token_ids,
                          sampled.to_host(), prompt_lps)

    def _forward(self, inp: StepInputs) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self._replay(inp.input_ids, inp.positions, inp.meta) if self.graphs else None
        if hidden is None:
            hidden = self.model(inp.input_ids, inp.positions, inp.meta, self.cos_sin_cache)
        return hidden

    @torch.inference_mode()
    def follow(self, header: dict) -> None:
        """Ranks 1..N-1: run the step rank 0 published (``rank_executor.pack_step``'s header; the
        buffers arrive by broadcast). The logits take part in the vocabulary gather, then go unused."""
        buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in header["buffer_bytes"]]
        for buf in buffers:
            torch.distributed.broadcast(buf, src=0, group=self.tp.group)
        input_ids, positions, meta, sample_rows = unpack_step(header, buffers)
        inp = StepInputs(input_ids, positions, AttentionMetadata(**meta), sample_rows, [])
        hidden = self._forward(inp)
        if inp.sample_rows.numel():
            self.model.compute_logits(hidden.index_select(0, inp.sample_rows))

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int, num_seqs: int, logit_rows: list[int] | None = None) -> None:
        """A throw-away step over the real pool: ``num_seqs`` fresh prompts sharing
        ``num_tokens`` query tokens (decode rows when they are equal). It stores
        nothing (slot -1) and reads whatever the blocks hold. The LM head and the greedy
        sampler's argmax (a Triton kernel on CUDA, compiled here rather than on the first
        request) run on the first n sampled rows for each n of ``logit_rows`` (default: all)."""
        dev, bs = self.device, self.block_size
        # no sequence longer than the model allows (positions index the rope cache / learned table)
        num_seqs = max(num_seqs, -(-num_tokens // (self.config.max_model_len - 1)))
        q_lens = _spread(num_tokens, num_seqs)
        q_len = q_lens[0]
        width = -(-q_len // bs)
        cu = [0, *itertools.accumulate(q_lens)]
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=dev),
            block_tables=(torch.arange(num_seqs * width, device=dev, dtype=torch.int32) % self.num_blocks).view(num_seqs, width),
            context_lens=torch.tensor(q_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            max_seqlen_q=q_len,
            decode_only=q_len == 1,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        pos = torch.cat([torch.arange(n, device=dev) for n in q_lens])
        hidden = self.model(ids, pos, meta, self.cos_sin_cache)
        rows = torch.tensor([c - 1 for c in cu[1:]], dtype=torch.long, device=dev)
        for n in logit_rows or [len(rows)]:
            self.sampler.greedy(self.model.compute_logits(hidden.index_select(0, rows[:n])))

    def warm_up(self) -> None:
        """Run, at start-up, the eager forms of what a step can meet (steps no graph
        covers, or all of them with ``enforce_eager``): prefill, mixed and decode batches
        of several sizes, so kernels are compiled and cuBLAS set up before the first
        request and the first call runs at the speed of the tenth."""
        if self.device.type != "cuda":
            return
        with self._tp_guard():
            self._warm_up()

    def _warm_up(self) -> None:
        cfg = self.config
        budget = min(cfg.max_num_batched_tokens, cfg.max_model_len * cfg.max_num_seqs)
        max_q = min(budget, cfg.max_model_len - 1)
        seqs = cfg.max_num_seqs
        shapes = {
            (budget, max(1, min(seqs, -(-budget // max_q)))),  # the biggest prefill step
            (budget - 1, max(1, min(seqs, 3, budget - 1))),
            (min(budget, 16 * 64), min(seqs, 16)),  # 16 prompts: sizes divisible by 16
            (min(budget, 1000), min(seqs, 7)),
            (min(budget, 257), 1),
            (min(budget, 16 + 3), min(seqs, 17)),  # prefill rows mixed with decode rows
            (min(budget, 17), min(seqs, 17)),  # eager decode, odd batch
            (min(budget, 16), min(seqs, 16)),
            (1, 1),
        }
        for num_tokens, num_seqs in sorted(shapes):
            if num_tokens >= num_seqs >= 1:
                self._dummy_forward(num_tokens, num_seqs)
        if self.sample_buckets:  # every row count the LM head meets (see prepare)
            rows = self.sample_buckets[-1]
            self._dummy_forward(rows, rows, logit_rows=self.sample_buckets)
        torch.cuda.synchronize(self.device)


def rank_runner(config: EngineConfig, tp: TPGroup) -> ModelRunner:
    """The runner of a spawned rank 1..N-1 (``rank_executor``'s ``build_runner``)."""
    return ModelRunner(config, set(), tp=tp)
