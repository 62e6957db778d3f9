"""The engine core in its own process against the engine in-process, on the GPU: the same
request mix (greedy, seeded n=2, stop strings held back and included, chat, a resumed request,
output_kind="final" with logprobs, an abort mid-run) driven through ``LLMEngine`` and through
``EngineProcess`` must give the same token ids, texts, finish reasons and logprob keys.

    . bench/device_env.sh && python3 bench/engine_process_parity.py [--shape llama-3.2-1b] [--enforce-eager]

Random-init weights at the shape's real size (bench/gpu_engine.py's model and tokenizer writers).
Exit status 1 when any sample differs; the first differences are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from gpu_engine import SHAPES  # bench/ is the script's own directory
from throughput import model_dir_for


def requests():
    from pagestream.engine import SamplingParams

    free = dict(ignore_eos=True)
    yield "greedy", dict(prompt="the quick brown fox", params=SamplingParams(temperature=0, max_tokens=48, **free))
    yield "seeded-n2", dict(prompt="once upon a time", params=SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=40, **free))
    yield "stop-str", dict(prompt="count with me", params=SamplingParams(temperature=0.8, seed=3, max_tokens=64, stop=["e"], **free))
    yield "stop-incl-n2", dict(prompt="two ways", params=SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=64, stop=["a", "o"],
                                                                        include_stop_str_in_output=True, **free))
    yield "resumed", dict(prompt_token_ids=list(range(5, 69)), resume_token_ids=[40, 41, 42],
                          params=SamplingParams(temperature=0.7, seed=11, max_tokens=32, **free))
    yield "final-lp", dict(prompt="whole at once", params=SamplingParams(temperature=0.6, seed=9, max_tokens=24, logprobs=3,
                                                                         output_kind="final", **free))
    for i in range(24):  # a batch wide enough to run the batched decode paths (graphs on CUDA)
        yield f"bulk-{i}", dict(prompt_token_ids=[(37 * i + j) % 990 + 3 for j in range(40 + 7 * i)],
                                params=SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=32 + i, **free))
    yield "aborted", dict(prompt="never mind", params=SamplingParams(temperature=0, max_tokens=400, **free))


def drive(engine) -> dict:
    for rid, kw in requests():
        engine.add_request(rid, **kw)
    got: dict = {}
    steps, aborted = 0, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                s = got.setdefault(f"{out.request_id}/{c.index}", {"ids": [], "text": "", "fin": None, "lps": []})
                s["ids"] += list(c.token_ids)
                s["text"] += c.text
                s["fin"] = [c.finish_reason, c.stop_reason] if c.finish_reason else s["fin"]
                s["lps"] += [sorted(d) for d in c.logprobs or []]
        steps += 1
        if steps >= 3 and not aborted:
            aborted = engine.abort_request("aborted")
    return got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a logic check of the script (fp32)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    from pagestream.engine import EngineConfig, LLMEngine
    from pagestream.engine.engine_process import EngineProcess

    device = torch.device(args.device)
    cfg = EngineConfig(model=model_dir_for(args.shape, device), device=device.type,
                       dtype="bfloat16" if device.type == "cuda" else "float32", gpu_memory_utilization=0.5,
                       max_model_len=2048, max_num_seqs=64, seed=0, enforce_eager=args.enforce_eager)
    local = drive(LLMEngine(cfg))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with EngineProcess(cfg) as proc:
        remote = drive(proc)
    diffs = [k for k in sorted(set(local) | set(remote)) if k != "aborted/0" and local.get(k) != remote.get(k)]
    aborted = (local["aborted/0"]["fin"], remote["aborted/0"]["fin"])
    ok = not diffs and aborted[0] == aborted[1] == ["abort", None]
    res = {"shape": args.shape, "enforce_eager": args.enforce_eager, "samples": len(local), "differing": diffs[:10],
           "aborted": aborted, "tokens": sum(len(v["ids"]) for v in local.values()), "ok": ok}
    for k in diffs[:3]:
        print("DIFF", k, json.dumps(local.get(k))[:400], "\n     ", json.dumps(remote.get(k))[:400])
    print(json.dumps(res))
    with open(os.path.join(args.out, f"engine_process_parity{'_eager' if args.enforce_eager else ''}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
