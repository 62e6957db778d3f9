"""Offline vs queue-fed step timelines from a `throughput.py --workloads 1b-queue-reps` result:
steps taken, time to the first step, median step in the decode phase, time after the last step.

    python3 bench/step_gaps.py bench/results/throughput_h200_....json
"""
import json
import statistics
import sys


def summary(ends: list, total_s: float) -> dict:
    times = [t for t, _ in ends]
    durs = [b - a for a, b in zip(times, times[1:])]
    full = [b - a for (a, n), (b, m) in zip(ends, ends[1:]) if n == m and n == max(k for _, k in ends)]
    return {"steps": len(ends), "first_step_end_s": times[0], "last_step_end_s": times[-1],
            "after_last_step_s": total_s - times[-1], "median_step_ms": 1e3 * statistics.median(durs),
            "median_full_batch_step_ms": 1e3 * statistics.median(full) if full else None,
            "steps_at_full_batch": len(full)}


def main(path: str) -> None:
    r = json.load(open(path))["1b-queue-reps"]
    for k, (ends, secs) in enumerate(zip(r["offline_step_ends"], r["offline_seconds"])):
        print("offline", k, {a: round(b, 4) for a, b in summary(ends, secs).items()})
    for k, rep in enumerate(r.get("reps", [r])):
        print("queue  ", k, {a: round(b, 4) for a, b in summary(rep["core_step_ends"], rep["seconds"]).items()})
        calls = rep.get("caller_steps")
        if calls:  # how far the worker's side ran behind the core: core steps done vs taken, over time
            ends = [t for t, _ in rep["core_step_ends"]]
            taken = 0
            lags = []
            for a, b, n in calls:
                taken += n
                done = sum(1 for t in ends if t <= a)
                lags.append((round(a, 3), done - taken, round(1e3 * (b - a), 2)))
            worst = max(lags, key=lambda x: x[1])
            print("  worker side:", len(calls), "step() calls; busiest call", max(round(1e3 * (b - a), 2) for a, b, _ in calls),
                  "ms; last", lags[-1], "(time, core steps not yet taken, ms turning them into outputs); most behind", worst)


if __name__ == "__main__":
    main(sys.argv[1])
