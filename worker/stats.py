"""What ``pagestream stats`` shows: per lane length, pending, consumers and idle time, DLQ, jobs/s.

On Redis Cluster a lane is several streams (``producer.protocol.lanes``): its figures are summed over
them, and a consumer's idle time is the shortest it has on any of them.
"""
from __future__ import annotations

import time
from typing import Any

import redis

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.lanes import resolve_layout
from pagestream.producer.protocol.wire import as_str


def _lane_info(client: redis.Redis, streams: list[str], group: str) -> dict[str, Any]:
    info: dict[str, Any] = {"length": 0, "pending": 0, "lag": None, "consumers": []}
    consumers: dict[str, dict[str, Any]] = {}
    for stream in streams:
        info["length"] += client.xlen(stream)
        try:
            for g in client.xinfo_groups(stream):
                if as_str(g["name"], "replace") == group:
                    info["pending"] += int(g["pending"])
                    lag = g.get("lag")
                    if lag is not None:
                        info["lag"] = (info["lag"] or 0) + int(lag)
            for c in client.xinfo_consumers(stream, group):
                name = as_str(c["name"], "replace")
                mine = consumers.setdefault(name, {"name": name, "pending": 0, "idle_ms": int(c["idle"])})
                mine["pending"] += int(c["pending"])
                mine["idle_ms"] = min(mine["idle_ms"], int(c["idle"]))
        except redis.ResponseError:
            pass  # no stream or group yet
    info["consumers"] = list(consumers.values())
    return info


def collect_stats(client: redis.Redis, group: str = keys.DEFAULT_GROUP, window_s: int = 10) -> dict[str, Any]:
    now = int(time.time())
    layout = resolve_layout(client)
    lanes: dict[str, Any] = {}
    for lane in keys.LANES:
        info = _lane_info(client, layout.streams(lane), group)
        # full seconds only: the current one is still filling. GETs, not one MGET: on a cluster
        # the counters live in different slots.
        pipe = client.pipeline(transaction=False)
        for i in range(window_s):
            pipe.get(keys.done_counter(lane, now - 1 - i))
        info["jobs_per_s"] = round(sum(int(c) for c in pipe.execute() if c) / window_s, 2)
        lanes[lane] = info
    workers = {}
    for key in client.scan_iter(match=keys.worker_hash("*"), count=1000):
        name = as_str(key, "replace")[len(keys.worker_hash("")):]
        workers[name] = {as_str(k, "replace"): as_str(v, "replace") for k, v in client.hgetall(key).items()}
    return {"lanes": lanes, "dead_letters": client.xlen(keys.dead_letter_stream()), "workers": workers}


def format_stats(data: dict[str, Any]) -> str:
    lines = [f"{'lane':<8}{'length':>8}{'pending':>9}{'lag':>7}{'jobs/s':>9}  consumers (pending, idle)"]
    for lane, i in data["lanes"].items():
        cons = ", ".join(f"{c['name']} ({c['pending']}, {c['idle_ms'] / 1000:.1f}s)" for c in i["consumers"]) or "-"
        lag = "-" if i["lag"] is None else str(i["lag"])
        lines.append(f"{lane:<8}{i['length']:>8}{i['pending']:>9}{lag:>7}{i['jobs_per_s']:>9}  {cons}")
    lines.append(f"dead letters: {data['dead_letters']}")
    for name, w in data["workers"].items():
        lines.append(
            f"worker {name}: running {w.get('num_running')}, waiting {w.get('num_waiting')}, "
            f"kv {float(w.get('kv_usage', 0)) * 100:.0f}% ({w.get('num_free_blocks')}/{w.get('num_total_blocks')} blocks free), "
            f"steps {w.get('num_steps')}, completed {w.get('num_completed')}"
        )
    return "\n".join(lines)
