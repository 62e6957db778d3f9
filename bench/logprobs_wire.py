"""What logprobs cost on the wire and on the worker's loop thread, SmolLM2-135M-Instruct on the CPU.

    .venv/bin/python bench/logprobs_wire.py [--max-tokens 128] [--ks 0,5,20]

For each k: the engine generates --max-tokens tokens (seeded sampling, EOS ignored) with
``logprobs=k``; the worker's ``TokenTexts`` turns them into the token events' wire form.
Reported: bytes per token of a token event without and with logprobs (the ``ev`` field as the
publisher writes it, one event per 8 tokens as coalescing gives at ~20 ms flushes), bytes per
token of the result JSON, and the loop thread's time per token in ``TokenTexts.encode`` with
its cache cold (first request) and warm (medians of 15 passes).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from pagestream.engine import LLM, SamplingParams
from pagestream.engine.smollm2 import ensure_smollm2
from pagestream.producer.protocol.schema import JobResult, SampleResult
from pagestream.producer.protocol.wire import token_event_fields
from pagestream.worker.logprobs import TokenTexts

EVENT_TOKENS = 8
REPEATS = 15


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", default="0,5,20")
    args = ap.parse_args()
    llm = LLM(ensure_smollm2(), device="cpu", seed=0)
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    print(f"{'k':>3} {'event B/token':>14} {'(no logprobs)':>14} {'result B/token':>15} {'encode us/token cold':>21} {'warm':>6}")
    for k in (int(x) for x in args.ks.split(",")):
        params = SamplingParams(temperature=0.8, seed=1, max_tokens=args.max_tokens, ignore_eos=True, logprobs=k)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        ids, lps = out.token_ids, out.logprobs
        cold_runs, warm_runs = [], []
        for _ in range(REPEATS):  # medians: one pass over 128 tokens is a few ms, easily disturbed
            texts = TokenTexts(llm.get_tokenizer())
            t0 = time.perf_counter()
            wire = texts.encode(ids, lps, k)
            cold_runs.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            texts.encode(ids, lps, k)
            warm_runs.append(time.perf_counter() - t0)
        cold = statistics.median(cold_runs) / len(ids) * 1e6
        warm = statistics.median(warm_runs) / len(ids) * 1e6
        with_lp = plain = 0
        for i in range(0, len(ids), EVENT_TOKENS):
            chunk = ids[i:i + EVENT_TOKENS]
            text = llm.get_tokenizer().decode(chunk)
            plain += len(token_event_fields(0, i, chunk, text, None)["ev"].encode())
            with_lp += len(token_event_fields(0, i, chunk, text, None, wire[i:i + EVENT_TOKENS])["ev"].encode())
        result = JobResult(job_id="j", status="completed", text=out.text, token_ids=ids,
                           outputs=[SampleResult(index=0, text=out.text, token_ids=ids, logprobs=wire)])
        plain_result = JobResult(job_id="j", status="completed", text=out.text, token_ids=ids,
                                 outputs=[SampleResult(index=0, text=out.text, token_ids=ids)])
        result_per_token = (len(result.model_dump_json()) - len(plain_result.model_dump_json())) / len(ids)
        print(f"{k:>3} {with_lp / len(ids):>14.0f} {plain / len(ids):>14.0f} {result_per_token:>15.0f} {cold:>21.1f} {warm:>6.1f}")
    print(json.dumps({"max_tokens": args.max_tokens, "event_tokens": EVENT_TOKENS}))


if __name__ == "__main__":
    main()
