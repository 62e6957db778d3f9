"""Reading the queue as it stands: per model and lane, how many jobs wait (the consumer group's lag), how many are in
flight and how old the oldest waiting one is, over every shard stream of a lane. One reading for everyone who shows
it: the gateway's ``pagestream_queue_*`` gauges and admission check (``producer/gateway``) and ``pagestream top``."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import redis

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.lanes import LaneLayout
from pagestream.producer.protocol.wire import as_str

#: models (the most recently announced first) whose lanes one reading covers
MAX_QUEUE_MODELS = 64
#: undelivered entries counted per stream when Redis cannot tell a group's lag (entries deleted behind it)
MAX_COUNTED_ENTRIES = 1000


@dataclass(slots=True)
class LaneQueue:
    """One lane of one model, summed over its shard streams."""

    depth: int = 0  # entries not yet delivered to the consumer group
    pending: int = 0  # delivered, not acknowledged
    oldest_ms: int | None = None  # unix ms of the oldest undelivered entry (from its stream id)


def _entry_ms(entry_id: Any) -> int:
    return int(as_str(entry_id).split("-", 1)[0])


async def _stream_queue(client: Any, stream: str, group: str, ages: bool) -> LaneQueue:
    """One lane stream's figures for ``group``: XINFO GROUPS (lag, pending, last delivered id), then (``ages``, or
    an unknown lag) one XRANGE past the last delivered id: the oldest undelivered entry, or up to
    ``MAX_COUNTED_ENTRIES`` of them counted when the lag is unknown. No stream yet: nothing queued; no group yet
    (no worker ever read it): every entry undelivered."""
    try:
        groups = await client.xinfo_groups(stream)
    except redis.ResponseError:  # no stream yet (a connection error is raised: it ends the read)
        return LaneQueue()
    g = next((g for g in groups if as_str(g.get("name"), "replace") == group), None)
    if g is None:
        depth = await client.xlen(stream)
        first = await client.xrange(stream, count=1) if depth and ages else []
        return LaneQueue(depth, 0, _entry_ms(first[0][0]) if first else None)
    last = as_str(g.get("last-delivered-id")) or "0-0"
    lag = g.get("lag")
    if lag is not None and not ages:
        return LaneQueue(int(lag), int(g.get("pending") or 0))
    after = await client.xrange(stream, min=f"({last}", count=1 if lag is not None else MAX_COUNTED_ENTRIES)
    depth = int(lag) if lag is not None else len(after)
    return LaneQueue(depth, int(g.get("pending") or 0), _entry_ms(after[0][0]) if after and depth else None)


async def queue_state(client: Any, layout: LaneLayout, model: str | None, group: str = keys.DEFAULT_GROUP,
                      ages: bool = True) -> dict[str, LaneQueue]:
    """Each lane of ``model``'s queue (every shard stream of it on a cluster: ``layout.streams``; None: the shared,
    model-less lanes), read now;
    ``ages=False``: depth and pending only (one command a stream while Redis knows the lag)."""
    out: dict[str, LaneQueue] = {}
    for lane in keys.LANES:
        total = LaneQueue()
        for part in await asyncio.gather(*(_stream_queue(client, s, group, ages) for s in layout.streams(lane, model))):
            total.depth += part.depth
            total.pending += part.pending
            if part.oldest_ms is not None:
                total.oldest_ms = part.oldest_ms if total.oldest_ms is None else min(total.oldest_ms, part.oldest_ms)
        out[lane] = total
    return out


@dataclass(slots=True)
class ModelQueue:
    """One announced model: until when some worker announced it serves it, and its lanes."""

    served_until_ms: int
    lanes: dict[str, LaneQueue]

    def served(self, now_ms: float) -> bool:
        """Some live worker serves it (its announcement, refreshed while a worker runs, has not run out)."""
        return self.served_until_ms > now_ms


async def fleet_queues(client: Any, layout: LaneLayout, group: str = keys.DEFAULT_GROUP,
                       max_models: int = MAX_QUEUE_MODELS) -> dict[str, ModelQueue]:
    """Every model ever announced (at most ``max_models``, the most recently announced first: a model whose
    workers are all gone, scaled to zero or crashed, is the one whose queue matters most) with its lanes, read
    now: what ``/metrics`` exports and ``pagestream top`` shows."""
    announced = await client.zrevrange(keys.model_registry(), 0, max_models - 1, withscores=True)
    return {as_str(m, "replace"): ModelQueue(int(score), await queue_state(client, layout, as_str(m, "replace"), group))
            for m, score in announced}
