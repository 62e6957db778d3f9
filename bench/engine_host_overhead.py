"""Host (Python) time of one engine decode step, with the model replaced by a no-op,
and the paged KV cache's waste (allocated slots holding no token) while decoding.

    .venv/bin/python bench/engine_host_overhead.py [--num-seqs 256] [--prompt-len 512] [--steps 100]
        [--tokenizer ~/.cache/pagestream/SmolLM2-135M-Instruct] [--output-kind delta|final]

What is left is the engine's own bookkeeping per step: scheduling, block-table
and input preparation, the sampler's argmax over a small vocabulary, stop checks
and building the incremental outputs. On the GPU the engine overlaps this with the
device's step (asynchronous scheduling), so decode is GPU-bound while it stays below
the step's kernel time (BENCHMARKS.md, "Engine throughput (H200)").
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch


class _NoOpModel(torch.nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.hidden, self.vocab = hidden, vocab

    def forward(self, input_ids, positions, meta, cos_sin_cache):
        return torch.zeros(input_ids.shape[0], self.hidden)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.vocab)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokenizer", default=None, help="an HF tokenizer directory (e.g. SmolLM2's): detokenization runs too")
    ap.add_argument("--output-kind", default="delta", choices=("delta", "final"),
                    help="delta: per-step outputs with text (the worker); final: whole outputs (LLM.generate)")
    ap.add_argument("--phases", action="store_true", help="also time each phase of the step (throughput.py's host_phases)")
    ap.add_argument("--core", action="store_true",
                    help="the worker's engine core process: token ids only (its caller detokenizes), outputs pickled")
    args = ap.parse_args()

    from pagestream.engine import LLM, SamplingParams
    from pagestream.engine.testing import write_tiny_model

    model_dir = write_tiny_model(tempfile.mkdtemp(prefix="pagestream-tiny-"), "llama", tokenizer_dir=args.tokenizer)
    llm = LLM(model_dir, device="cpu", max_num_seqs=args.num_seqs, max_model_len=1024,
              kv_cache_bytes=2**30, max_num_batched_tokens=args.num_seqs * args.prompt_len)
    engine = llm.llm_engine
    engine.runner.model = _NoOpModel(64, 1000)
    if args.core:
        import pickle

        from pagestream.engine.core_messages import CoreOutput, CoreOutputType
        from pagestream.engine.output_processor import core_params

        # the worker's engine core (EngineCore, as engine/core_process.py runs it): token ids only (its
        # caller detokenizes), outputs pickled for the pipe
        core = engine.core
        plain_step = core.step
        engine = core
        engine.step = lambda: pickle.dumps(CoreOutput(CoreOutputType.OUTPUTS, plain_step(), None), protocol=pickle.HIGHEST_PROTOCOL)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=(2 if args.phases else 1) * args.steps + 40, ignore_eos=True, output_kind=args.output_kind)
    for i in range(args.num_seqs):
        ids = [rng.randrange(3, 1000) for _ in range(args.prompt_len)]
        if args.core:
            engine.add_request(i, ids, [], core_params(params))
        else:
            engine.add_request(str(i), prompt_token_ids=ids, params=params)
    while engine.scheduler.waiting:
        engine.step()
    engine.step()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    ms = (time.perf_counter() - t) / args.steps * 1000
    print(f"host time per decode step, {args.num_seqs} sequences ({'engine core: token ids, pickled' if args.core else args.output_kind + ' outputs'}, "
          f"{'tokenizer' if args.tokenizer else 'no tokenizer'}): {ms:.2f} ms")
    if args.phases:
        from throughput import host_cprofile, host_phases  # bench/ is on sys.path when run as a script

        print("host ms per step by phase:", host_phases(engine, args.steps // 2))
        print("\n".join(host_cprofile(engine, args.steps // 2)))
    # Paged-KV waste over the next steps: allocated slots that hold no token (the tail of
    # each sequence's last block), the figure PagedAttention keeps under 4%.
    waste = []
    for _ in range(16):
        engine.step()
        waste.append(engine.stats().kv_waste)
    print(f"KV waste over 16 decode steps (block_size {engine.config.block_size}): "
          f"mean {100 * sum(waste) / len(waste):.2f}%, max {100 * max(waste):.2f}%")


if __name__ == "__main__":
    main()
