"""``pagestream top``: the fleet live in a terminal (rich), for an SSH session.

Built from the reads the rest of pagestream already makes, not from new ones: the queue per model and lane is
``protocol/queue_state.py`` (what the gateway's ``/metrics`` exports as ``pagestream_queue_*``), the workers,
dead letters and jobs/s are ``collect_stats`` (``pagestream stats``), the recent failures are the job-event
firehose's ``failed`` / ``dead_lettered`` events (``protocol/events.py``).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pagestream.producer.protocol.queue_state import LaneQueue, ModelQueue, fleet_queues, queue_state
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.events import Event, EventField, EventType
from pagestream.producer.protocol.lanes import resolve_layout
from pagestream.worker.stats import collect_stats

#: the model column of the lanes shared by every model (jobs submitted without one)
SHARED = "(any model)"
#: events read back from the firehose's end to find the latest failures
FAILURE_SCAN = 2000
FAILURE_TYPES = {EventType.FAILED, EventType.DEAD_LETTERED}


@dataclass
class Frame:
    """One reading of the fleet."""

    at: float
    queues: dict[str, ModelQueue]
    stats: dict[str, Any]
    failures: list[Event] = field(default_factory=list)


def recent_failures(client: Any, limit: int = 8) -> list[Event]:
    """The newest ``limit`` failed or dead-lettered jobs in the event stream (newest first)."""
    out = []
    for entry_id, raw in client.xrevrange(keys.events_stream(), count=FAILURE_SCAN):
        ev = Event.parse(entry_id, raw)
        if ev.type in FAILURE_TYPES:
            out.append(ev)
            if len(out) == limit:
                break
    return out


async def read_frame(client: Any, aclient: Any, layout: Any, failures: int = 8) -> Frame:
    queues = await fleet_queues(aclient, layout)
    shared = await queue_state(aclient, layout, None)
    if any(q.depth or q.pending for q in shared.values()):
        queues = {**queues, SHARED: ModelQueue(0, shared)}
    return Frame(time.time(), queues, collect_stats(client), recent_failures(client, failures))


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _lane_age(q: LaneQueue, now_ms: float) -> str:
    return "-" if q.oldest_ms is None else _age((now_ms - q.oldest_ms) / 1000)


def render(frame: Frame) -> Group:
    now_ms = frame.at * 1000
    workers = frame.stats["workers"]
    per_model: dict[str, int] = {}
    for w in workers.values():
        per_model[w.get("model", "")] = per_model.get(w.get("model", ""), 0) + 1
    rate = sum(lane["jobs_per_s"] for lane in frame.stats["lanes"].values())
    head = Text.assemble(("pagestream top", "bold"), f"  {time.strftime('%H:%M:%S', time.localtime(frame.at))}",
                         f"  workers {len(workers)}", f"  jobs/s {rate:g}",
                         ("  dead letters ", ""), (str(frame.stats["dead_letters"]), "red" if frame.stats["dead_letters"] else ""))

    queues = Table(title="queues", title_justify="left", expand=False)
    for col, just in (("model", "left"), ("lane", "left"), ("queued", "right"), ("in flight", "right"),
                      ("oldest", "right"), ("workers", "right")):
        queues.add_column(col, justify=just)
    for model, mq in frame.queues.items():
        served = model == SHARED or mq.served(now_ms)
        n = str(per_model.get(model, 0)) if model != SHARED else "-"
        for lane, q in mq.lanes.items():
            style = "red" if q.depth and not served else ""
            queues.add_row(model, lane, str(q.depth), str(q.pending), _lane_age(q, now_ms),
                           n if served else "none", style=style)
    if not frame.queues:
        queues.add_row("(no model announced yet)", "", "", "", "", "")

    wt = Table(title="workers", title_justify="left")
    for col, just in (("worker", "left"), ("model", "left"), ("running", "right"), ("waiting", "right"),
                      ("KV", "right"), ("tokens/s", "right"), ("done", "right"), ("heartbeat", "right")):
        wt.add_column(col, justify=just)
    for name, w in sorted(workers.items()):
        try:
            kv = f"{float(w.get('kv_usage', 0)) * 100:.0f}%"
            beat = _age(frame.at - float(w["updated_at"])) + " ago" if w.get("updated_at") else "-"
        except ValueError:
            kv, beat = "?", "?"
        wt.add_row(name, w.get("model", "?"), w.get("num_running", "?"), w.get("num_waiting", "?"), kv,
                   w.get("tokens_per_s", "?"), w.get("num_completed", "?"), beat)
    if not workers:
        wt.add_row("(no live worker)", "", "", "", "", "", "", "")

    ft = Table(title="recent failures", title_justify="left")
    for col in ("when", "type", "job", "model", "error"):
        ft.add_column(col, overflow="fold" if col == "error" else "ellipsis")
    for ev in frame.failures:
        ft.add_row(_age(frame.at - ev.ts) + " ago", str(getattr(ev.type, "value", ev.type)), ev.job,
                   ev.fields.get(EventField.MODEL, ""), ev.fields.get(EventField.ERROR, "")[:200])
    if not frame.failures:
        ft.add_row("-", "", "", "", "none")
    return Group(head, queues, wt, ft)


def run_top(url: str, interval_s: float = 1.0, once: bool = False, console: Console | None = None) -> None:
    """Print frames every ``interval_s`` until interrupted (``once``: one frame, then return)."""
    from pagestream.producer.protocol.redis_conn import connect, connect_async

    console = console or Console()
    client = connect(url)
    layout = resolve_layout(client)

    async def main() -> None:
        aclient = connect_async(url)
        try:
            frame = await read_frame(client, aclient, layout)
            if once:
                console.print(render(frame))
                return
            with Live(render(frame), console=console, refresh_per_second=4, screen=False, transient=False) as live:
                while True:
                    await asyncio.sleep(interval_s)
                    live.update(render(await read_frame(client, aclient, layout)))
        finally:
            await aclient.aclose()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
