"""Host (CPU) cost of the torch calls one engine step makes, on the machine at hand.

    python3 bench/host_ops.py [--device cuda] [--n 256]

Each row is the median wall time of one call issued from Python (nothing waits for the
device, except where a row says so), so the step's host budget can be split between
Python bookkeeping and the torch/CUDA calls themselves.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def timed(fn, reps=2000) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=256)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    n = args.n
    host = torch.zeros(8192, dtype=torch.long, pin_memory=cuda)
    d = torch.zeros(8192, dtype=torch.long, device=dev)
    d2 = torch.zeros(8192, dtype=torch.long, device=dev)
    idx = torch.arange(n, device=dev)
    lst = list(range(n))
    rows = {
        "torch.zeros(8192, pin_memory)": lambda: torch.zeros(8192, dtype=torch.long, pin_memory=cuda),
        "torch.empty(8192, pin_memory)": lambda: torch.empty(8192, dtype=torch.long, pin_memory=cuda),
        "host.to(device, non_blocking)": lambda: host.to(dev, non_blocking=True),
        "dev.copy_(host, non_blocking)": lambda: d.copy_(host, non_blocking=True),
        "dev[:n].copy_(dev2[:n])": lambda: d[:n].copy_(d2[:n]),
        "dev[n:2n].fill_(1)": lambda: d[n : 2 * n].fill_(1),
        "slice view t[a:b]": lambda: d[16:272],
        "dev[idx] = dev2[idx]": lambda: d.__setitem__(idx, d2[idx]),
        "index_select": lambda: d.index_select(0, idx),
        f"torch.tensor(list of {n})": lambda: torch.tensor(lst),
        f"host[:n].numpy()[:] = list of {n}": lambda: host[:n].numpy().__setitem__(slice(None), lst),
        f"host[:n].tolist()": lambda: host[:n].tolist(),
        "host.numpy()": lambda: host.numpy(),
    }
    if cuda:
        ev = torch.cuda.Event()
        rows["Event() + record()"] = lambda: torch.cuda.Event().record()
        rows["event.synchronize() (done)"] = lambda: (ev.record(), torch.cuda.synchronize(), ev.synchronize())
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            d.add_(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(100):
                d.add_(1)
        rows["graph.replay() (100 tiny kernels)"] = g.replay
    out = {}
    for name, fn in rows.items():
        out[name] = round(timed(fn), 2)
        if cuda:
            torch.cuda.synchronize()
    print(json.dumps({"device": str(dev), "us_per_call_median": out}, indent=1))


if __name__ == "__main__":
    main()
