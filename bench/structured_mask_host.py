"""The host time of one step's grammar work at batch 256 (issue 23, acceptance 5), on the CPU alone:
every sequence's matcher takes its new token and the step's bitmask is filled, through
``StructuredOutputManager.accept`` / ``fill_bitmask`` as the engine calls them.

    python3 bench/structured_mask_host.py [--rows 256] [--steps 120] [--threads 1,2,4,8] [--out DIR]

Modes, each over the same recorded token streams (random walks through bench/structured.py's JSON
schema on its synthetic 128,256-token vocabulary, made once with the mask): ``one-by-one`` (every
matcher timed alone each call, as before the batch calls: two Python calls into xgrammar per
sequence), and ``batch-T`` (the manager's batch accept and a batch fill over T threads). Prints
ms per step (median over steps; each step's accept + fill) and checks that every mode's bitmasks
are identical to one-by-one's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured import SCHEMA  # noqa: E402
from throughput import write_tokenizer  # noqa: E402

VOCAB = 128256
STOP = [128001, 128008, 128009]


def manager(tok, threads):
    from pagestream.engine.structured_output import StructuredOutputManager, StructuredOutputsParams

    m = StructuredOutputManager(tok, VOCAB, stop_token_ids=STOP, max_threads=1, batch_threads=threads)
    m.add_request("r", StructuredOutputsParams(json=SCHEMA))
    m.backend.result(m._pending["r"].future)
    assert m.is_ready("r")
    return m


def record(tok, rows, steps, seed=0):
    """Random walks through the grammar: each row's token stream (a sample of the mask's allowed ids)."""
    m = manager(tok, 1)
    gs = [m.grammar(f"s{i}", "r") for i in range(rows)]
    gen = torch.Generator().manual_seed(seed)
    shifts = torch.arange(32, dtype=torch.int32)
    streams = [[] for _ in range(rows)]
    for _ in range(steps):
        live = [i for i, g in enumerate(gs) if not g.is_terminated()]
        if not live:
            break
        bitmask, _ = m.fill_bitmask([gs[i] for i in live])
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(len(live), -1)[:, :VOCAB].float()
        picks = torch.multinomial(allowed, 1, generator=gen).squeeze(1).tolist()
        for i, t in zip(live, picks):
            assert gs[i].accept_tokens([t])
            streams[i].append(t)
    return streams


def replay(tok, streams, threads, one_by_one: bool, masks=None):
    """Step through the recorded streams; per step: accept (after the first) + fill, timed."""
    m = manager(tok, threads)
    rows = len(streams)
    gs = [m.grammar(f"s{i}", "r") for i in range(rows)]
    times, out_masks = [], []
    steps = max(len(s) for s in streams)
    for k in range(steps + 1):
        live = [i for i in range(rows) if k <= len(streams[i])]
        t0 = time.perf_counter()
        if k:
            grammars = [gs[i] for i in live]
            if one_by_one:
                for g in grammars:
                    g.cost = None
            refused = m.accept(grammars, [streams[i][k - 1] for i in live])
            assert not refused
        rows_k = [None if gs[i].is_terminated() else gs[i] for i in live]
        if one_by_one:
            for g in rows_k:
                if g is not None:
                    g.cost = None
        bitmask, constrained = m.fill_bitmask(rows_k)
        times.append(time.perf_counter() - t0)
        if masks is not None:
            out_masks.append(bitmask[constrained].clone())
    return times, out_masks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = os.path.join(tempfile.gettempdir(), "pagestream-structured-mask-tok")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        write_tokenizer(path, VOCAB, chars="".join(map(chr, range(32, 127))))
    tok = AutoTokenizer.from_pretrained(path)
    t0 = time.perf_counter()
    cache = os.path.join(path, f"streams-{args.rows}-{args.steps}.json")
    if os.path.exists(cache):
        streams = json.load(open(cache))
    else:
        streams = record(tok, args.rows, args.steps)
        json.dump(streams, open(cache, "w"))
    print(f"recorded {args.rows} streams, {sum(map(len, streams))} tokens, mean {statistics.mean(map(len, streams)):.1f}"
          f" ({time.perf_counter() - t0:.1f} s)", flush=True)
    modes = [("one-by-one", 1, True)] + [(f"batch-{t}", int(t), False) for t in args.threads.split(",")]
    _, ref = replay(tok, streams, 1, True, masks=True)
    res = {"rows": args.rows, "steps": args.steps, "cpus": os.cpu_count(), "modes": {}}
    for name, threads, one in modes:
        _, masks = replay(tok, streams, threads, one, masks=True)
        same = len(masks) == len(ref) and all(torch.equal(a, b) for a, b in zip(masks, ref))
        per_rep = []
        for _ in range(args.repeat):
            times, _ = replay(tok, streams, threads, one)
            full = [t for t, k in zip(times, range(len(times))) if sum(k <= len(s) for s in streams) == args.rows]
            per_rep.append(1e3 * statistics.median(full[1:] or times))
        res["modes"][name] = {"ms_per_step_full_batch_median": per_rep, "masks_equal_one_by_one": same}
        print(f"{name:>11}: ms/step at {args.rows} rows (median, each repeat) "
              f"{' '.join(f'{x:.3f}' for x in per_rep)}  masks equal: {same}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "structured_mask_host.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
