"""One worker's side of the consumer group: read, reclaim, keep leases, ack, dead-letter, trim.

Each lane is one stream (``ps:jobs:{lane}``) with one group; on Redis Cluster each lane
is ``lane_shards`` streams (``producer.protocol.lanes``), and this consumer reads, reclaims, trims
and refreshes every one of them. Entries are named by a "lane key" (``normal`` for shard
0, ``normal/3`` for shard 3), which is what ``Delivery.lane`` holds. An entry is "held"
by this consumer from XREADGROUP/XAUTOCLAIM until XACK; while held, its idle
time is reset every ``lease_ms / 3`` so other workers only reclaim entries of
consumers that stopped doing so (dead or hung).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import redis

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.lanes import resolve_layout
from pagestream.producer.protocol.schema import DeadLetter
from pagestream.worker.settings import WorkerSettings
from pagestream.producer.protocol.wire import as_str

log = logging.getLogger(__name__)
T = TypeVar("T")

# Keep the idle time of entries this consumer still owns at zero; report those it lost
# (reclaimed by another consumer after a lease expired). Checking ownership and
# resetting idle in one script means we never XCLAIM an entry away from its new owner.
# KEYS: stream. ARGV: group, consumer, ids...
_REFRESH_LUA = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

#: field that stands in for the payload of an entry cut down by ``_READ_LUA`` (value: its size in bytes)
OVERSIZED_FIELD = b"__oversized_bytes__"

# Read (XREADGROUP, no BLOCK) or reclaim (XAUTOCLAIM) entries, cutting any entry over
# max_bytes down to its first keep_bytes before it leaves Redis: whatever a raw XADD
# queued, one pull costs the worker at most count x max_bytes. A reclaimed entry comes
# with a third element: the consumer that held it (for the ``reclaimed`` event).
# KEYS: stream. ARGV: 'read'|'claim'|'ids', group, consumer, count, id (read) or min_idle_ms (claim), max_bytes,
# keep_bytes, then (ids) the entry ids
_READ_LUA = """
local entries
if ARGV[1] == 'read' then
  local resp = redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[3], 'COUNT', ARGV[4], 'STREAMS', KEYS[1], ARGV[5])
  if not resp then return {} end
  entries = resp[1][2]
elseif ARGV[1] == 'ids' then
  -- entries of this consumer's PEL by id (ARGV[8] on), claimed again to it (a delivery each); deleted ones drop out.
  -- Only those still in this consumer's PEL: one another worker reclaimed since they were listed is its now.
  local mine = {}
  for i = 8, #ARGV do
    if #redis.call('XPENDING', KEYS[1], ARGV[2], ARGV[i], ARGV[i], 1, ARGV[3]) > 0 then table.insert(mine, ARGV[i]) end
  end
  if #mine == 0 then return {} end
  entries = {}
  for _, e in ipairs(redis.call('XCLAIM', KEYS[1], ARGV[2], ARGV[3], 0, unpack(mine))) do
    if type(e) == 'table' then
      if e[2] == nil then e[2] = false end
      table.insert(entries, e)
    end
  end
else
  -- who held each entry before it is claimed (the same entries XAUTOCLAIM takes: idle past the lease, oldest first)
  local owner = {}
  for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[2], 'IDLE', ARGV[5], '-', '+', ARGV[4])) do owner[p[1]] = p[2] end
  entries = redis.call('XAUTOCLAIM', KEYS[1], ARGV[2], ARGV[3], ARGV[5], '0-0', 'COUNT', ARGV[4])[2]
  for _, e in ipairs(entries) do
    if e[2] == nil then e[2] = false end
    e[3] = owner[e[1]] or ''
  end
end
local max_bytes, keep = tonumber(ARGV[6]), tonumber(ARGV[7])
for _, e in ipairs(entries) do
  local f = e[2]
  if f then
    local size = 0
    for i = 1, #f do size = size + #f[i] end
    if size > max_bytes then
      local cut = {'""" + OVERSIZED_FIELD.decode() + """', tostring(size)}
      local left = keep
      for i = 1, #f, 2 do
        if left <= #f[i] then break end
        local v = string.sub(f[i + 1], 1, left - #f[i])
        left = left - #f[i] - #v
        table.insert(cut, f[i])
        table.insert(cut, v)
      end
      e[2] = cut
    end
  end
end
return entries
"""


@dataclass(slots=True)
class Delivery:
    """One lane entry handed to this consumer."""

    lane: str
    entry_id: str
    fields: dict[bytes, bytes] | None  # None: the entry was deleted from the stream
    deliveries: int = 1
    # a delivery that took the entry over: the consumer that held it (XAUTOCLAIM after its lease lapsed, or an
    # entry it handed back), or this consumer's own name for an entry an earlier process under it left pending;
    # None for an entry read new
    claimed_from: str | None = None


def entry_size(fields: dict[bytes, bytes] | None) -> int:
    """Bytes of a raw stream entry (field names and values), as queued even if it was cut on reading."""
    size = sum(len(k) + len(v) for k, v in (fields or {}).items())
    queued = (fields or {}).get(OVERSIZED_FIELD, b"")
    return max(size, int(queued)) if queued.isdigit() else size


def is_nogroup(exc: BaseException) -> bool:
    """Redis lost the consumer group (or the whole stream): FLUSHALL, a restart without persistence, a failover."""
    return isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc)


class Consumer:
    def __init__(self, client: redis.Redis, settings: WorkerSettings) -> None:
        # ``client`` must return bytes (decode_responses=False): payloads may be non-UTF-8.
        self.redis = client
        self.settings = settings
        self.group = settings.group
        self.name = settings.consumer
        self.layout = resolve_layout(client)
        # every stream this consumer reads, as lane keys: high's shards before normal's before low's
        self.lanes_by_priority = [self.layout.lane_keys(lane) for lane in settings.lanes]
        self.lanes = [key for shards in self.lanes_by_priority for key in shards]
        self._streams = {key: self.layout.stream(key, settings.served_model_name) for key in self.lanes}
        self._turn = 0  # which shard of each lane is read first (round robin, so no shard starves)
        # cluster only (_read_sharded): the newest doorbell entry seen, whether the last scan of the
        # shards stopped early, when the next scan is due even without a ring
        self._bell_last: bytes | None = None
        self._backlog = True
        self._next_scan = 0.0
        self._refresh = client.register_script(_REFRESH_LUA)
        self._read_cut = client.register_script(_READ_LUA)
        self._delete_idle = client.register_script(_DELETE_IDLE_LUA)

    def _pull(self, lane: str, mode: str, count: int, arg: str | int) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
        """Entries of one lane (``_READ_LUA``), oversized ones cut down, fields as a dict (None: deleted)."""
        return [(row[0], row[1]) for row in self._pull_rows(lane, mode, count, arg)]

    def _pull_rows(self, lane: str, mode: str, count: int, arg: str | int, ids: list[str] = ()) -> list[tuple]:
        """``_pull``'s rows; a reclaimed one has a third element, the consumer that held it."""
        rows = self._read_cut(keys=[self.stream(lane)], args=[
            mode, self.group, self.name, count, arg, self.settings.max_entry_bytes, self.settings.dead_letter_payload_bytes,
            *ids,
        ])
        return [(row[0], dict(zip(row[1][::2], row[1][1::2])) if row[1] else None, *row[2:]) for row in rows]

    def stream(self, lane: str) -> str:
        """The stream behind a lane key (``normal``, or ``normal/3`` for a shard on a cluster)."""
        stream = self._streams.get(lane)
        return stream if stream is not None else self.layout.stream(lane, self.settings.served_model_name)

    def _read_order(self) -> list[str]:
        """Lane keys in the order to read now: by lane priority, each lane's shards rotated by one per call."""
        if not self.layout.sharded:
            return self.lanes
        self._turn += 1
        order = []
        for shards in self.lanes_by_priority:
            k = self._turn % len(shards)
            order.extend(shards[k:] + shards[:k])
        return order

    def ensure_groups(self) -> None:
        """Create the group on every lane (from id 0: jobs submitted before any worker existed count)."""
        for lane in self.lanes:
            try:
                self.redis.xgroup_create(self.stream(lane), self.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def _regrouped(self, call: Callable[[], T]) -> T:
        """Run a group command; if Redis lost the group, recreate every lane's group and run it again."""
        try:
            return call()
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
        log.warning("consumer group %r is gone (Redis lost its state: FLUSHALL, restart without persistence "
                    "or failover); recreating it on %s", self.group, self.lanes)
        self.ensure_groups()
        return call()

    # -- reading -------------------------------------------------------------------------

    def recover_own(self, max_count: int) -> list[Delivery]:
        """Entries already in this consumer's PEL (a restart under the same name)."""
        return self._regrouped(lambda: self._recover_own(max_count))

    def _recover_own(self, max_count: int) -> list[Delivery]:
        out: list[Delivery] = []
        for lane in self.lanes:
            if len(out) >= max_count:
                break
            # held by an earlier process under this name: taken over as a reclaim is
            out.extend(self._with_counts(lane, self._pull(lane, "read", max_count - len(out), "0"), from_self=True))
        return out

    def recover_unknown(self, known: set[tuple[str, str]], max_count: int) -> list[Delivery]:
        """Entries in this consumer's PEL that are not in ``known`` (what the worker holds): a read whose reply a
        dropped connection lost (redis-py retries the command on a fresh connection, so the worker never saw
        those entries, which would otherwise wait out their lease before a reclaim took them).

        Cheap when there are none: one XPENDING summary per lane, compared with what ``known`` holds there. Only
        where this consumer holds more are its entries listed, and the unknown ones claimed again (cut down as any
        read is; a delivery each, so a job whose first reply was lost reports 2).
        """
        return self._regrouped(lambda: self._recover_unknown(known, max_count))

    def _recover_unknown(self, known: set[tuple[str, str]], max_count: int) -> list[Delivery]:
        pipe = self.redis.pipeline(transaction=False)
        for lane in self.lanes:
            pipe.xpending(self.stream(lane), self.group)
        out: list[Delivery] = []
        for lane, summary in zip(self.lanes, pipe.execute()):
            n = max_count - len(out)
            held_here = sum(1 for held_lane, _ in known if held_lane == lane)
            ours = next((int(c["pending"]) for c in summary.get("consumers") or [] if as_str(c["name"]) == self.name), 0)
            if n <= 0 or ours <= held_here:
                continue
            pending = self.redis.xpending_range(self.stream(lane), self.group, min="-", max="+", count=ours,
                                                consumername=self.name)
            ids = [i for i in (as_str(p["message_id"]) for p in pending) if (lane, i) not in known][:n]
            if ids:  # never taken over: a first start (no ``reclaimed`` event), with the count Redis keeps
                rows = self._pull_rows(lane, "ids", len(ids), 0, ids)
                out.extend(Delivery(d.lane, d.entry_id, d.fields, d.deliveries) for d in self._with_counts(lane, rows))
        return out

    def read(self, max_count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to ``max_count`` new entries, high lane before normal before low.

        With ``block_ms`` and nothing available, waits on all lanes at once (on a cluster: on
        the producers' doorbell, then reads every shard).
        """
        return self._regrouped(lambda: self._read(max_count, block_ms))

    def _read(self, max_count: int, block_ms: int | None) -> list[Delivery]:
        out: list[Delivery] = []
        if max_count <= 0:
            return out
        if self.layout.sharded:
            return self._read_sharded(max_count, block_ms)
        self._read_lanes(out, max_count)
        if out or not block_ms:
            return out
        # one entry at most: the one read that is not cut down by _READ_LUA (Lua cannot block)
        resp = self.redis.xreadgroup(
            self.group, self.name, {self.stream(lane): ">" for lane in self.lanes}, count=1, block=block_ms
        )
        lane_of = {self.stream(lane): lane for lane in self.lanes}
        for stream, entries in resp or []:
            out.extend(Delivery(lane_of[as_str(stream)], as_str(i), f, 1) for i, f in entries)
        if out:
            # The entry that woke us is usually the first of a burst (submit_many, a bulk feeder):
            # take what else is there now, so the engine starts on the burst rather than on one job.
            self._read_lanes(out, max_count)
        return out[:max_count]

    def _read_lanes(self, out: list[Delivery], max_count: int) -> None:
        """Append new entries to ``out`` until it holds ``max_count``, high lane before normal before low."""
        for lane in self.lanes:
            n = max_count - len(out)
            if n <= 0:
                break
            out.extend(Delivery(lane, as_str(i), f, 1) for i, f in self._pull(lane, "read", n, ">"))

    def _read_sharded(self, max_count: int, block_ms: int | None) -> list[Delivery]:
        """``read`` on a cluster, where a lane is many streams in different slots.

        Scanning every shard costs one call per shard, so it happens only when the last scan filled
        ``max_count`` (a backlog) or ``block_ms`` passed since the last full scan (an entry queued
        without the doorbell, by a raw XADD). Otherwise a read is one non-blocking XREAD of the
        producers' doorbell (``keys.lane_bell``, rung after their entries are in, naming the
        shards), and only the shards it names are read. One XREADGROUP cannot block on several
        slots: an idle worker blocks on the bell instead.
        """
        if self._bell_last is None:  # first read: note the bell before the first scan, so no ring is missed
            newest = self.redis.xrevrange(keys.lane_bell(), count=1)
            self._bell_last = newest[0][0] if newest else b"0-0"
            self._backlog = True
        if self._backlog or time.monotonic() >= self._next_scan:
            out = self._scan(max_count)
        else:
            rung = self._bell_rang(None)
            out = self._scan(max_count, rung) if rung else []
        if out or not block_ms:
            return out
        rung = self._bell_rang(block_ms)
        return self._scan(max_count, rung) if rung else []

    def _bell_rang(self, block_ms: int | None) -> set[str]:
        """Lane keys of this worker that producers rang since the last look (empty: none)."""
        resp = self.redis.xread({keys.lane_bell(): self._bell_last}, count=1000, block=block_ms)
        mine = (self.settings.served_model_name or "").encode()
        rung: set[str] = set()
        for _, entries in resp or []:
            for entry_id, fields in entries:
                self._bell_last = entry_id
                if fields.get(b"model", b"") == mine:
                    rung.update(as_str(k) for k in fields.get(b"lanes", b"").split(b",") if k)
        return rung & set(self.lanes)

    def _scan(self, max_count: int, only: set[str] | None = None) -> list[Delivery]:
        """Read every shard (or those in ``only``), lanes by priority, shards round robin, until ``max_count`` entries."""
        out: list[Delivery] = []
        for lane in self._read_order():
            n = max_count - len(out)
            if n <= 0:
                break
            if only is None or lane in only:
                out.extend(Delivery(lane, as_str(i), f, 1) for i, f in self._pull(lane, "read", n, ">"))
        if len(out) >= max_count:
            self._backlog = True  # stopped early: more may be waiting
        elif only is None:
            self._backlog = False
            self._next_scan = time.monotonic() + self.settings.block_ms / 1000
        return out

    def reclaim(self, max_count: int) -> list[Delivery]:
        """XAUTOCLAIM entries idle longer than the lease (their consumer stopped refreshing)."""
        return self._regrouped(lambda: self._reclaim(max_count))

    def _reclaim(self, max_count: int) -> list[Delivery]:
        out: list[Delivery] = []
        for lane in self.lanes:
            n = max_count - len(out)
            if n <= 0:
                break
            out.extend(self._with_counts(lane, self._pull_rows(lane, "claim", n, self.settings.lease_ms)))
        return out

    def _with_counts(self, lane: str, entries: list, from_self: bool = False) -> list[Delivery]:
        """Deliveries of taken-over entries ((id, fields[, previous owner]) rows), with their delivery counts."""
        if not entries:
            return []
        stream = self.stream(lane)
        pipe = self.redis.pipeline(transaction=False)
        for row in entries:
            pipe.xpending_range(stream, self.group, min=row[0], max=row[0], count=1)
        counts = []
        for rows in pipe.execute():
            counts.append(int(rows[0]["times_delivered"]) if rows else 1)
        return [Delivery(lane, as_str(row[0]), row[1] or None, c,
                         self.name if from_self else as_str(row[2]) if len(row) > 2 else "")
                for row, c in zip(entries, counts)]

    # -- leases, acks, dead letters ---------------------------------------------------------

    def refresh_leases(self, held: dict[str, list[str]]) -> list[tuple[str, str]]:
        """Reset idle time of held entries; return (lane, entry_id) of those lost to another consumer."""
        lost: list[tuple[str, str]] = []
        for lane, ids in held.items():
            for start in range(0, len(ids), 256):
                chunk = ids[start : start + 256]
                try:
                    found = self._refresh(keys=[self.stream(lane)], args=[self.group, self.name, *chunk])
                except redis.ResponseError as exc:
                    if not is_nogroup(exc):
                        raise
                    # the group and its PEL are gone with whatever Redis lost: nothing of ours is held there
                    log.warning("consumer group %r on lane %s is gone; dropping %d held entries", self.group, lane, len(ids))
                    self.ensure_groups()
                    lost.extend((lane, eid) for eid in ids)
                    break
                lost.extend((lane, as_str(entry_id)) for entry_id in found)
        return lost

    def release(self, deliveries: list[Delivery], count_delivery: bool = False) -> None:
        """Hand entries back: mark them idle past the lease so any worker reclaims them at once.

        A stop is not the job's fault, so by default the delivery is not counted toward
        ``max_deliveries`` (the reclaim will count the next one).
        """
        for d in deliveries:
            try:
                self.redis.xclaim(
                    self.stream(d.lane), self.group, self.name, 0, [d.entry_id],
                    idle=self.settings.lease_ms + 1,
                    retrycount=None if d.deliveries <= 0 else d.deliveries if count_delivery else d.deliveries - 1,
                    justid=True,
                )
            except redis.RedisError as exc:
                log.warning("could not release %s: %s", d.entry_id, exc)

    def ack(self, lane: str, entry_ids: list[str], pipeline: redis.client.Pipeline | None = None) -> None:
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=False)
        pipe.xack(self.stream(lane), self.group, *entry_ids)
        if pipeline is None:
            pipe.execute()

    def dead_letter(
        self,
        delivery: Delivery,
        reason: str,
        job_id: str | None = None,
        pipeline: redis.client.Pipeline | None = None,
    ) -> None:
        """Copy the entry (payload, reason, delivery count) to the DLQ and XACK it, atomically.

        The DLQ keeps at most ``dead_letter_payload_bytes`` of the payload; a ``truncated``
        field says how big the entry was, so one oversized entry does not cost its size twice.
        """
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=True)
        meta = DeadLetter(
            lane=delivery.lane,
            entry_id=delivery.entry_id,
            job_id=job_id,
            reason=reason,
            deliveries=delivery.deliveries,
            worker=self.name,
        )
        fields: dict[str | bytes, bytes | str] = {"meta": meta.model_dump_json()}
        budget = self.settings.dead_letter_payload_bytes
        payload = delivery.fields or {}
        kept = 0
        for k, v in payload.items():
            k = k if isinstance(k, bytes) else k.encode()
            if kept + len(k) > budget:
                break
            v = v[: budget - kept - len(k)]
            fields[b"payload:" + k] = v
            kept += len(k) + len(v)
        size = entry_size(payload)
        if kept < size:
            fields["truncated"] = json.dumps({"entry_bytes": size, "kept_bytes": kept, "fields": len(payload)})
        pipe.xadd(keys.dead_letter_stream(), fields, maxlen=self.settings.dead_letter_maxlen, approximate=True)
        pipe.xack(self.stream(delivery.lane), self.group, delivery.entry_id)
        if pipeline is None:
            pipe.execute()

    # -- trimming ---------------------------------------------------------------------------

    def remove_stale_consumers(self, idle_ms: int) -> list[str]:
        """XGROUP DELCONSUMER every consumer of our lanes that holds no entries (no lease to lose)
        and has not read for ``idle_ms``: workers that stopped or died stay listed otherwise.
        A live worker reads at least every ``block_ms``, and one removed anyway is recreated
        by its next read. Returns the removed names (once per consumer)."""
        return self._delete_consumers(lambda name, idle: name != self.name and idle >= idle_ms)

    def leave(self) -> bool:
        """On a clean stop: remove this consumer from the group of every lane where it holds nothing."""
        return bool(self._delete_consumers(lambda name, idle: name == self.name))

    def _delete_consumers(self, which: Callable[[str, int], bool]) -> list[str]:
        removed: set[str] = set()
        for lane in self.lanes:
            try:
                consumers = self.redis.xinfo_consumers(self.stream(lane), self.group)
            except redis.ResponseError:
                continue  # no stream or group yet
            for c in consumers:
                name = as_str(c["name"])
                if int(c["pending"]) or not which(name, int(c["idle"])):
                    continue
                # DELCONSUMER drops what the consumer holds: the script checks, atomically, that it holds nothing
                if self._delete_idle(keys=[self.stream(lane)], args=[self.group, name]):
                    removed.add(name)
        return sorted(removed)

    def trim(self) -> dict[str, int]:
        """Drop acked entries: XTRIM MINID up to the oldest entry any group still needs.

        An entry is still needed if it is pending in some group or not yet delivered to
        some group (after its last-delivered-id). Returns entries removed per lane.
        """
        removed: dict[str, int] = {}
        for lane in self.lanes:
            stream = self.stream(lane)
            try:
                groups = self.redis.xinfo_groups(stream)
            except redis.ResponseError:
                continue
            if not groups:
                continue
            floor: tuple[int, int] | None = None
            for g in groups:
                name = as_str(g["name"])
                summary = self.redis.xpending(stream, name)
                candidates = [_next_id(as_str(g["last-delivered-id"]))]
                if summary["pending"]:
                    candidates.append(_parse_id(as_str(summary["min"])))
                low = min(candidates)
                floor = low if floor is None else min(floor, low)
            if floor is not None and floor > (0, 0):
                removed[lane] = self.redis.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False)
        return removed


# KEYS: lane stream. ARGV: group, consumer. Deletes the consumer only while it holds no entry.
_DELETE_IDLE_LUA = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


def _parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _next_id(entry_id: str) -> tuple[int, int]:
    ms, seq = _parse_id(entry_id)
    return ms, seq + 1


def now_ms() -> int:
    return int(time.time() * 1000)
