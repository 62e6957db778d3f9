"""What the dashboard shows, read from Redis for one tenant (``/dashboard/api/state`` and the SSE feed).

Tenant scoping (issue 22's rules, ``producer.protocol.tenants``): what says nothing about anyone's work, the
fleet's shape, is shown to every key: queue depth and oldest age per model and lane, the workers and their
engine figures, and the throughput and latency charts (counts and seconds, no ids). What names a tenant's
work is shown to its owner and to an admin only: job ids, finish reasons and error texts of finished and
failed jobs, dead letters, bulks and batches. A job's owner is the ``tenant`` in its metadata (the gateway
stamps it); a job made outside the gateway has none and belongs to ``anonymous`` (seen by an admin, or on an
open gateway). An event whose owner cannot be read (its job hash expired) is treated as someone else's.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from typing import Any

from pagestream.producer.gateway.metrics import SHARED_LANE_PREFIX
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.bulk import BulkField, BulkStatus
from pagestream.producer.protocol.events import Event, EventField, EventType
from pagestream.producer.protocol.job import JobField
from pagestream.producer.protocol.queue_state import fleet_queues, queue_state
from pagestream.producer.protocol.schema import DeadLetter
from pagestream.producer.protocol.tenants import ANONYMOUS, TENANT_FIELD, Tenant
from pagestream.producer.protocol.wire import JOB_FIELD, as_str

#: the charts' window and bucket
CHART_WINDOW_S = 15 * 60
CHART_BUCKET_S = 10
#: events read back for the charts and the lists when a page loads (the newest first)
HISTORY_EVENTS = 20_000
#: rows of each list (finished jobs, failures, dead letters, bulks)
LIST_ROWS = 25
#: job -> owner lookups remembered per gateway (an owner never changes)
OWNER_CACHE = 50_000

#: the events a job's row in "latest jobs" is made of, and those that are failures
FINAL_TYPES = {EventType.FINISHED, EventType.FAILED, EventType.CANCELLED, EventType.DEAD_LETTERED}
FAILURE_TYPES = {EventType.FAILED, EventType.DEAD_LETTERED}
#: what every key may see of any event: the charts' inputs, no ids and no texts (``ttft_s``: seconds from submit to
#: first token, on the worker's first_token events)
AGGREGATE_FIELDS = (EventField.MODEL, EventField.TOKENS, EventField.QUEUE_S, EventField.RUN_S, EventField.TTFT_S)


def _num(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def aggregate_view(ev: Event) -> dict[str, Any]:
    """An event as anyone may see it: its type, time and figures (what the charts add up)."""
    out: dict[str, Any] = {"type": str(getattr(ev.type, "value", ev.type)), "ts": ev.ts}
    for k in AGGREGATE_FIELDS:
        if k in ev.fields:
            out[k] = ev.fields[k] if k == EventField.MODEL else _num(ev.fields[k])
    return out


def full_view(ev: Event) -> dict[str, Any]:
    """An event as its owner sees it: everything it carries."""
    out = aggregate_view(ev)
    out["id"] = ev.id
    out["job"] = ev.job
    for k in (EventField.WORKER, EventField.FINISH_REASON, EventField.ERROR, EventField.LANE, EventField.BULK,
              EventField.BATCH, EventField.DONE, EventField.FAILED, EventField.TOTAL):
        if k in ev.fields:
            out[k] = ev.fields[k]
    return out


def _metadata_owner(job_json: Any) -> str | None:
    """The ``tenant`` in a job's (or result's) JSON metadata; ``ANONYMOUS`` when it has none; None: unreadable."""
    try:
        meta = json.loads(as_str(job_json, "replace")).get("metadata") or {}
    except (ValueError, AttributeError):
        return None
    owner = meta.get(TENANT_FIELD) if isinstance(meta, dict) else None
    return owner if isinstance(owner, str) and owner else ANONYMOUS


class Owners:
    """Who owns a job, read from its final result's metadata and remembered (LRU)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._cache: OrderedDict[str, str | None] = OrderedDict()

    async def of(self, jobs: list[str]) -> dict[str, str | None]:
        missing = [j for j in dict.fromkeys(jobs) if j and j not in self._cache]
        if missing:
            pipe = self.client.pipeline(transaction=False)
            for j in missing:
                pipe.hget(keys.job_hash(j), JobField.RESULT)
            for j, raw in zip(missing, await pipe.execute()):
                self._cache[j] = None if raw is None else _metadata_owner(raw)
                if self._cache[j] is None:
                    self._cache.pop(j)  # not final yet, or expired: ask again next time
            while len(self._cache) > OWNER_CACHE:
                self._cache.popitem(last=False)
        return {j: self._cache.get(j) for j in jobs}


def _owned(tenant: Tenant, owner: str | None) -> bool:
    return owner is not None and tenant.owns(owner)


async def visible(tenant: Tenant, owners: Owners, events: list[Event]) -> list[dict[str, Any]]:
    """Each event as ``tenant`` may see it: in full when it owns the event's job (an admin owns all),
    else its aggregate view; events with no job (bulk progress) are the bulk's owner's (not read here: full
    for an admin only)."""
    if tenant.admin:
        return [full_view(ev) for ev in events]
    owner = await owners.of([ev.job for ev in events if ev.job and ev.type in FINAL_TYPES])
    return [full_view(ev) if ev.job and _owned(tenant, owner.get(ev.job)) else aggregate_view(ev) for ev in events]


async def queues(producer: Any) -> list[dict[str, Any]]:
    """Every announced model's lanes and the shared ones (the ``/metrics`` gauges' figures: ``fleet_queues``)."""
    client = producer.redis
    layout = await producer.layout()
    fleet, shared = await asyncio.gather(fleet_queues(client, layout), queue_state(client, layout, None))
    now_ms = time.time() * 1000
    lanes = [(model, lane, q) for model, mq in fleet.items() for lane, q in mq.lanes.items()]
    lanes += [("", SHARED_LANE_PREFIX + lane, q) for lane, q in shared.items()]
    rows = []
    for model, lane, q in lanes:
        age = 0.0 if q.oldest_ms is None else max(0.0, (now_ms - q.oldest_ms) / 1000)
        rows.append({"model": model, "lane": lane, "depth": q.depth, "pending": q.pending, "oldest_age_s": round(age, 1)})
    return rows


async def workers(client: Any) -> list[dict[str, Any]]:
    """Every worker whose heartbeat hash is alive (refreshed each second, expires after 15 s)."""
    prefix = keys.worker_hash("")
    names = sorted({as_str(k, "replace") async for k in client.scan_iter(match=keys.worker_hash("*"), count=1000)})
    pipe = client.pipeline(transaction=False)
    for k in names:
        pipe.hgetall(k)
    now = time.time()
    rows = []
    for k, raw in zip(names, await pipe.execute() if names else []):
        h = {as_str(a, "replace"): as_str(b, "replace") for a, b in raw.items()}
        if not h:
            continue  # expired between the scan and the read
        updated = _num(h.get("updated_at"))
        rows.append({
            "name": k[len(prefix):], "model": h.get("model", ""), "running": int(_num(h.get("num_running")) or 0),
            "waiting": int(_num(h.get("num_waiting")) or 0), "kv_usage": _num(h.get("kv_usage")) or 0.0,
            "tokens_per_s": _num(h.get("tokens_per_s")), "completed": int(_num(h.get("num_completed")) or 0),
            "heartbeat_age_s": None if updated is None else round(max(0.0, now - updated), 1),
        })
    return rows


async def bulks(client: Any, tenant: Tenant) -> list[dict[str, Any]]:
    """The newest bulks and batches ``tenant`` owns (an admin: every one), with their counts."""
    index = keys.bulk_index() if tenant.admin else keys.tenant_bulks_index(tenant.name)
    ids = [as_str(b, "replace") for b in await client.zrevrange(index, 0, LIST_ROWS - 1)]
    pipe = client.pipeline(transaction=False)
    for b in ids:
        pipe.hgetall(keys.bulk_hash(b))
    rows = []
    for b, raw in zip(ids, await pipe.execute() if ids else []):
        h = {as_str(k, "replace"): as_str(v, "replace") for k, v in raw.items()}
        if not h or not tenant.owns(h.get(BulkField.TENANT)):
            continue
        try:
            model = json.loads(h.get(BulkField.SPEC, "{}")).get("model")
        except ValueError:
            model = None
        counts = {f: int(_num(h.get(f)) or 0) for f in (BulkField.SUBMITTED, BulkField.INVALID, BulkField.COMPLETED,
                                                          BulkField.FAILED, BulkField.SKIPPED)}
        status = h.get(BulkField.STATUS, "")
        done = counts[BulkField.COMPLETED] + counts[BulkField.FAILED] + counts[BulkField.INVALID] + counts[BulkField.SKIPPED]
        # the total is known once the whole input is read; before that, the lines read so far (a skipped line is
        # a submitted one that a cancel skipped: counted in SUBMITTED already, as OpenAI's request_counts count it)
        total = counts[BulkField.SUBMITTED] + counts[BulkField.INVALID]
        final = status in {s.value for s in BulkStatus if s.is_final}
        rows.append({"id": b, "status": status, "model": model, **counts, "done": done, "total": total,
                     "input_done": bool(h.get(BulkField.INPUT_DONE)), "final": final,
                     "created_at": _num(h.get(BulkField.CREATED_AT)), "error": h.get(BulkField.ERROR) or None})
    return rows


async def dead_letters(client: Any, tenant: Tenant) -> tuple[int, list[dict[str, Any]]]:
    """How many dead letters there are (anyone may know), and the newest ``tenant`` owns, with their reasons."""
    stream = keys.dead_letter_stream()
    total = await client.xlen(stream)
    rows = []
    for entry_id, raw in await client.xrevrange(stream, count=LIST_ROWS * 4):
        f = {as_str(k, "replace"): v for k, v in raw.items()}
        try:
            meta = DeadLetter.model_validate_json(f.get("meta", b"{}"))
        except ValueError:
            continue
        # the owner is in the job's payload (truncated past the DLQ's payload budget: unknown, so not shown)
        payload = f.get("payload:" + JOB_FIELD)
        owner = _metadata_owner(payload) if payload is not None else ANONYMOUS
        if not _owned(tenant, owner):
            continue
        rows.append({"id": as_str(entry_id), "job": meta.job_id, "reason": meta.reason, "lane": meta.lane,
                     "deliveries": meta.deliveries, "worker": meta.worker, "at": meta.at})
        if len(rows) >= LIST_ROWS:
            break
    return total, rows


async def history(client: Any, now: float, upto: str) -> list[Event]:
    """The events of the charts' window up to id ``upto``, oldest first (at most ``HISTORY_EVENTS`` of the newest)."""
    since_ms = int((now - CHART_WINDOW_S) * 1000)
    raw = await client.xrevrange(keys.events_stream(), max=upto, min=f"{since_ms}-0", count=HISTORY_EVENTS)
    return [Event.parse(i, f) for i, f in reversed(raw)]


async def snapshot(producer: Any, tenant: Tenant, owners: Owners, with_history: bool = True) -> dict[str, Any]:
    """What the page shows, read now: see the module's docstring. ``with_history``: also the events of the
    charts' window (when the page loads; the feed then adds each new one), and the id of the newest."""
    client = producer.redis
    now = time.time()

    async def no_history() -> list[Event]:
        return []

    last_id = "0-0"
    if with_history:  # pinned first: the feed follows from it, so no event falls between the history and the feed
        last = await client.xrevrange(keys.events_stream(), count=1)
        last_id = as_str(last[0][0]) if last else "0-0"

    q, w, b, (dlq_total, dlq), events = await asyncio.gather(
        queues(producer), workers(client), bulks(client, tenant), dead_letters(client, tenant),
        history(client, now, last_id) if with_history else no_history())
    out: dict[str, Any] = {
        "now": now, "tenant": {"name": tenant.name, "admin": tenant.admin},
        "window_s": CHART_WINDOW_S, "bucket_s": CHART_BUCKET_S,
        "queues": q, "workers": w, "bulks": b, "dead_letters_total": dlq_total, "dead_letters": dlq,
    }
    if with_history:
        out["events"] = await visible(tenant, owners, events)
        out["last_event_id"] = last_id
    return out
