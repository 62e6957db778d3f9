"""Host time of the steps at the end of an `LLM.generate` batch, on the CPU with a no-op model: 256 prompts
of 512 tokens, prefilled 32 at a time, so 32 samples finish on each of the last 8 steps.

    OMP_NUM_THREADS=1 .venv/bin/python bench/host_tail.py [--out-tokens 256]

Prints each of the last steps (sequences running before it, ms, ms per phase) and a summary: the median
finishing step, the median of its outputs phase (the whole-text decodes, unless they run beside the loop),
and the last step (which waits for texts still decoding). The tokenizer is throughput.py's (a fast
tokenizer of 1,000 words, as the no-op model's vocabulary).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_host_overhead import _NoOpModel  # noqa: E402
from phase_timers import timed_methods  # noqa: E402
from throughput import write_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-tokens", type=int, default=256)
    args = ap.parse_args()

    from pagestream.engine import LLM, SamplingParams
    from pagestream.engine.testing import write_tiny_model

    tok_dir = tempfile.mkdtemp()
    write_tokenizer(tok_dir, 1000)
    model_dir = write_tiny_model(tempfile.mkdtemp(prefix="pagestream-tiny-"), "llama", tokenizer_dir=tok_dir)
    llm = LLM(model_dir, device="cpu", max_num_seqs=256, max_model_len=1024, kv_cache_bytes=2**30,
              max_num_batched_tokens=16384)
    engine = llm.llm_engine
    engine.runner.model = _NoOpModel(64, 1000)
    acc: dict[str, float] = {}
    targets = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "execute", "execute"),
               (engine.scheduler, "finish", "finish"), (engine.core, "_read_tokens", "read_tokens"),
               (engine.output_processor, "process", "outputs")]
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=args.out_tokens, ignore_eos=True, output_kind="final")
    for i in range(256):
        engine.add_request(f"b{i}", prompt_token_ids=[rng.randrange(3, 1000) for _ in range(512)], params=sp)
    rows = []
    with timed_methods(acc, targets):
        while engine.has_unfinished_requests():
            acc.clear()
            running = len(engine.scheduler.running)
            t = time.perf_counter()
            engine.step()
            rows.append((running, 1e3 * (time.perf_counter() - t), {k: round(1e3 * v, 2) for k, v in acc.items()}))
    for r in rows[-10:]:
        print(r[0], round(r[1], 2), r[2])
    finishing = [r for r in rows[-10:-1] if r[0] < 256]
    print("finishing steps: median %.2f ms, their outputs phase median %.2f ms; last step %.2f ms" % (
        statistics.median(r[1] for r in finishing), statistics.median(r[2].get("outputs", 0.0) for r in finishing),
        rows[-1][1]))


if __name__ == "__main__":
    main()
