"""Issue 37, acceptance 3: a 40-byte ambiguous grammar beside 16 ordinary requests.

    .venv/bin/python bench/grammar_budget.py [--model DIR] [--rounds 3] [--out bench/results/grammar_budget_cpu.json]

SmolLM2-135M-Instruct on the CPU (``engine.smollm2.ensure_smollm2``), as in the issue's report. Each round
runs the same 16 ordinary requests (16 tokens each, temperature 0, one batch) twice, alternately: alone, and
with the hostile request (``root ::= a / a ::= a a a | a a | "x" | ""``, ``min_tokens`` 300) added at the
same instant. Reported per run: the seconds until the last ordinary request finished and each one's own
seconds and each step's milliseconds while they run; the ratio with/without (acceptance: within 1.2x); and how the hostile request ended (acceptance:
an error naming the bound, not 300 tokens). Unbounded, the report measured 5.6 s -> 73.5 s (13x).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


HOSTILE = 'root ::= a\na ::= a a a | a a | "x" | ""'
PROMPTS = [f"Write one sentence about the number {i}." for i in range(16)]


def run_once(engine, with_hostile: bool, tag: str) -> dict:
    from pagestream import SamplingParams, StructuredOutputsParams

    ordinary = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}-o{i}", p, ordinary)
    if with_hostile:
        engine.add_request(f"{tag}-hostile", "Write x's.", SamplingParams(
            temperature=0.0, min_tokens=300, max_tokens=300,
            structured_outputs=StructuredOutputsParams(grammar=HOSTILE)))
    done: dict[str, float] = {}
    hostile = None
    step_ms: list[int] = []  # each step's wall time until the last ordinary request is done
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        if len(done) < len(PROMPTS):
            step_ms.append(round((time.perf_counter() - t) * 1000))
        for out in outs:
            if out.finished:
                if out.request_id.endswith("hostile"):
                    hostile = {"seconds": round(time.perf_counter() - start, 3), "error": out.error,
                               "finish_reason": out.outputs[0].finish_reason if out.outputs else None,
                               "tokens": len(out.outputs[0].token_ids) if out.outputs else 0}
                else:
                    done[out.request_id] = time.perf_counter() - start
    assert len(done) == len(PROMPTS), done
    return {"ordinary_last_s": round(max(done.values()), 3), "ordinary_p50_s": round(statistics.median(done.values()), 3),
            "hostile": hostile, "step_ms": step_ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="an HF model directory (SmolLM2-135M-Instruct by default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/grammar_budget_cpu.json")
    args = ap.parse_args()
    from pagestream.engine.llm_engine import LLMEngine
    from pagestream.engine.config import EngineConfig

    model = args.model
    if model is None:
        from pagestream.engine.smollm2 import ensure_smollm2

        model = ensure_smollm2()
    engine = LLMEngine(EngineConfig(model=model, device="cpu", max_num_seqs=32))
    run_once(engine, False, "warm")  # first-use costs (allocations, the grammar backend's import) outside the figures
    rows = []
    for r in range(args.rounds):
        alone = run_once(engine, False, f"r{r}a")
        beside = run_once(engine, True, f"r{r}b")
        rows.append({"alone": alone, "with_hostile": beside,
                     "ratio_last": round(beside["ordinary_last_s"] / alone["ordinary_last_s"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    cfg = engine.config
    result = {"argv": sys.argv, "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
              "model": model, "grammar_step_limit_ms": cfg.grammar_step_limit_ms,
              "grammar_request_limit_s": cfg.grammar_request_limit_s, "rounds": rows,
              "ratio_last_max": max(x["ratio_last"] for x in rows),
              "ratio_last_median": statistics.median(x["ratio_last"] for x in rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
