"""Summarise a `throughput.py` result: each workload's time, fraction of the floor, HF ratio, and the
1b-fixed step timeline in 16-step means (ms), so a call's log shows where the run went.

    python3 bench/fixed_summary.py $OUT/throughput.json [more.json ...]
"""
import json
import statistics
import sys

for path in sys.argv[1:]:
    res = json.load(open(path))
    print(path, res.get("ceilings"))
    for name, r in res.items():
        if not isinstance(r, dict) or "seconds" not in r:
            continue
        keys = ("seconds", "frac_of_floor", "floor_s", "hf_static_s", "x_hf_static", "vs_offline", "ttft_p50_s",
                "preemptions", "max_queue_wait_s")
        print(" ", name, {k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in keys if k in r})
        ends = r.get("step_ends")
        if ends:
            t = [a for a, _ in ends]
            durs = [1e3 * (b - a) for a, b in zip(t, t[1:])]
            print("   first step end %.4f s; step ms by 16s:" % t[0],
                  [round(statistics.mean(durs[i:i + 16]), 2) for i in range(8, len(durs), 16)])
            print("   last 10 steps (end s, running):", [(round(a, 4), n) for a, n in ends[-10:]])
