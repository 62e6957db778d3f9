"""The webhook consumer: ``ps:events`` read through a consumer group, each event POSTed to one URL.

Delivery is at least once and loses nothing the stream still holds:

- entries are read with XREADGROUP, so the group remembers where it is across restarts;
- an entry is XACKed only after the URL answered 2xx; until then it stays in the group's pending list;
- on start the consumer first re-delivers its own pending entries (a restart under the same name),
  then, every ``claim_idle_ms / 2``, takes over entries another consumer left pending longer than
  ``claim_idle_ms`` (XAUTOCLAIM: a consumer that was killed);
- a failed attempt (non-2xx, timeout, connection error) is retried with exponential backoff and jitter,
  honouring ``Retry-After``, for as long as it takes; ``410 Gone`` stops the consumer (the spec: the
  receiver wants no more), leaving the entry pending.

So a receiver sees an event more than once after a crash or a lost answer; every attempt carries the
event's stream id as ``webhook-id``, the idempotency key it dedupes by. Events of one job go through one
delivery lane, in stream order; lanes run concurrently. Order is not kept across a takeover: events a dead
consumer left pending may arrive after later events of the same job (the event's ``ts`` says when it happened).
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import queue
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.backoff import EqualJitterBackoff

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.events import Event
from pagestream.producer.protocol.wire import as_str
from pagestream.producer.webhook.signing import secret_key, signed_headers

log = logging.getLogger(__name__)

ENV_PREFIX = "PAGESTREAM_WEBHOOK_"
DEFAULT_GROUP = "webhook"
#: statuses after which the next attempt waits at least what ``Retry-After`` says
THROTTLE_STATUSES = frozenset({429, 502, 503, 504})


def default_consumer() -> str:
    """``webhook-<hostname>``: a consumer restarted on the same host takes its own pending entries back at once."""
    return f"webhook-{socket.gethostname()}"


class WebhookSettings(BaseSettings):
    """Env: ``PAGESTREAM_WEBHOOK_`` + field name upper-cased (``PAGESTREAM_WEBHOOK_URL``, ``..._SECRET``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", hide_input_in_errors=True)

    url: str
    secret: SecretStr
    group: str = DEFAULT_GROUP
    consumer: str = Field(default_factory=default_consumer)
    # where a group that does not exist yet starts: "$" the events from now on, "0" every event the stream keeps
    start_id: str = "$"
    # another consumer's entry pending this long is taken over (its consumer is presumed dead)
    claim_idle_ms: int = Field(60_000, ge=1)
    concurrency: int = Field(8, ge=1, le=256)  # deliveries in flight at once (one lane per job hash)
    timeout_s: float = Field(15.0, gt=0)  # per HTTP attempt (the spec recommends 15-30 s)
    backoff_base_s: float = Field(0.5, gt=0)  # the first retry's delay, doubling per failure
    backoff_cap_s: float = Field(60.0, gt=0)  # the longest delay between two attempts
    read_count: int = Field(100, ge=1)  # entries per XREADGROUP / XAUTOCLAIM
    block_ms: int = Field(1000, ge=1)  # how long one XREADGROUP waits for new events


def event_body(ev: Event) -> bytes:
    """The POST body: ``{"id", "type", "timestamp" (ISO 8601 UTC, when the change happened), "data"}``,
    ``data`` being the event's fields as the stream holds them (``producer.protocol.events``)."""
    when = dt.datetime.fromtimestamp(ev.ts, dt.timezone.utc).isoformat().replace("+00:00", "Z")
    doc = {"id": ev.id, "type": getattr(ev.type, "value", ev.type), "timestamp": when, "data": ev.fields}
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


class EndpointGone(Exception):
    """The URL answered 410 Gone: it wants no more deliveries."""


@dataclass(slots=True)
class Stats:
    delivered: int = 0
    failed_attempts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class WebhookConsumer:
    """Follows the events stream as ``settings.consumer`` of ``settings.group`` and delivers to ``settings.url``.

    ``run()`` blocks until ``stop()`` (or a 410); entries not yet acked then stay pending for the next start.
    """

    def __init__(self, client: redis.Redis, settings: WebhookSettings, http: httpx.Client | None = None) -> None:
        self.redis = client
        self.settings = settings
        self.stream = keys.events_stream()
        self._key = secret_key(settings.secret.get_secret_value())
        pool = httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency)
        self._http = http or httpx.Client(timeout=settings.timeout_s, limits=pool, follow_redirects=False)
        self._stop = threading.Event()
        self._lanes: list[queue.Queue] = [queue.Queue() for _ in range(settings.concurrency)]
        self._slots = threading.BoundedSemaphore(settings.concurrency * 4)  # read-ahead bound
        self._in_flight: set[str] = set()
        self._in_flight_lock = threading.Lock()
        self.stats = Stats()
        self.gone: EndpointGone | None = None
        self._trim_reported = (0, 0)

    # -- the group -------------------------------------------------------------------------------

    def ensure_group(self, start_id: str | None = None) -> None:
        start_id = start_id or self.settings.start_id
        try:
            self.redis.xgroup_create(self.stream, self.settings.group, id=start_id, mkstream=True)
            log.info("created group %s on %s at %s", self.settings.group, self.stream, start_id)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self.ensure_group()
        lanes = [threading.Thread(target=self._lane, args=(q,), name=f"webhook-lane-{i}", daemon=True)
                 for i, q in enumerate(self._lanes)]
        for t in lanes:
            t.start()
        try:
            self._own_pending()
            next_claim = 0.0
            while not self._stop.is_set():
                try:
                    if time.monotonic() >= next_claim:
                        self._claim_abandoned()
                        self._check_trimmed()
                        next_claim = time.monotonic() + self.settings.claim_idle_ms / 2000
                    self._read_new()
                except redis.ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    # the stream went away with its group (a FLUSHALL, a restart without persistence): every
                    # event of the new stream is unread, so the group starts at its beginning
                    log.warning("group %s on %s is gone: recreating it", self.settings.group, self.stream)
                    self.ensure_group(start_id="0")
        finally:
            self._stop.set()
            for t in lanes:
                t.join(timeout=self.settings.timeout_s + 1)
            self._http.close()
        if self.gone is not None:
            raise self.gone

    def _own_pending(self) -> None:
        """What this consumer was given before a restart and never acked, oldest first."""
        cursor = "0"
        while not self._stop.is_set():
            entries = _group_entries(self.redis.xreadgroup(self.settings.group, self.settings.consumer,
                                                           {self.stream: cursor}, count=self.settings.read_count))
            if not entries:
                return
            for entry_id, fields in entries:
                cursor = entry_id
                self._dispatch(entry_id, fields)

    def _claim_abandoned(self) -> None:
        """Entries other consumers left pending longer than ``claim_idle_ms`` become this consumer's."""
        cursor = "0-0"
        while not self._stop.is_set():
            reply = self.redis.xautoclaim(self.stream, self.settings.group, self.settings.consumer,
                                          self.settings.claim_idle_ms, start_id=cursor, count=self.settings.read_count)
            cursor = as_str(reply[0])
            for entry_id, fields in reply[1]:
                self._dispatch(as_str(entry_id), fields)
            for entry_id in (reply[2] if len(reply) > 2 else []):  # Redis 7: trimmed away while pending
                log.error("event %s was trimmed from %s before it was delivered (raise PAGESTREAM_EVENTS_MAXLEN)",
                          as_str(entry_id), self.stream)
            if cursor == "0-0":
                return

    def _check_trimmed(self) -> None:
        """Log when the stream's cap has removed events the group had not read yet (they are lost to it):
        the group is behind the oldest entry kept, and entries were removed from the stream's head."""
        try:
            info = self.redis.xinfo_stream(self.stream)
            group = next((g for g in self.redis.xinfo_groups(self.stream) if as_str(g["name"]) == self.settings.group), None)
        except redis.ResponseError:  # the stream is gone (a FLUSHALL): the next read recreates it with the group
            return
        first = info.get("first-entry")
        if group is None or not first:
            return
        oldest_kept = _id_tuple(first[0])
        removed_some = int(info.get("entries-added") or 0) > int(info.get("length") or 0)
        behind = _id_tuple(group.get("last-delivered-id"))
        if removed_some and oldest_kept > behind and oldest_kept > self._trim_reported:
            self._trim_reported = oldest_kept
            log.error("events of %s after %s and before %s were trimmed before group %s read them (raise "
                      "PAGESTREAM_EVENTS_MAXLEN or add consumers)", self.stream, "-".join(map(str, behind)),
                      "-".join(map(str, oldest_kept)), self.settings.group)

    def _read_new(self) -> None:
        entries = _group_entries(self.redis.xreadgroup(self.settings.group, self.settings.consumer, {self.stream: ">"},
                                                       count=self.settings.read_count, block=self.settings.block_ms))
        for entry_id, fields in entries:
            self._dispatch(entry_id, fields)

    # -- delivery --------------------------------------------------------------------------------

    def _dispatch(self, entry_id: str, fields: Any) -> None:
        if not fields:  # pending, but trimmed from the stream: nothing left to send
            log.error("event %s was trimmed from %s before it was delivered (raise PAGESTREAM_EVENTS_MAXLEN)",
                      entry_id, self.stream)
            self.redis.xack(self.stream, self.settings.group, entry_id)
            return
        with self._in_flight_lock:
            if entry_id in self._in_flight:  # our own, claimed back while a lane still retries it
                return
            self._in_flight.add(entry_id)
        while not self._slots.acquire(timeout=0.2):
            if self._stop.is_set():
                self._done(entry_id, release=False)
                return
        ev = Event.parse(entry_id, fields)
        self._lanes[zlib.crc32((ev.job or ev.id).encode()) % len(self._lanes)].put(ev)

    def _done(self, entry_id: str, release: bool = True) -> None:
        with self._in_flight_lock:
            self._in_flight.discard(entry_id)
        if release:
            self._slots.release()

    def _lane(self, q: queue.Queue) -> None:
        while not self._stop.is_set():
            try:
                ev = q.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if self._deliver(ev):
                    self.redis.xack(self.stream, self.settings.group, ev.id)
                    with self.stats.lock:
                        self.stats.delivered += 1
            except EndpointGone as exc:
                self.gone = exc
                self._stop.set()
            except Exception:  # a lane never dies; the entry stays pending and is claimed back later
                log.exception("delivering event %s", ev.id)
            finally:
                self._done(ev.id)

    def _deliver(self, ev: Event) -> bool:
        """POST ``ev`` until a 2xx (True) or a stop (False: it stays pending)."""
        body = event_body(ev)
        backoff = EqualJitterBackoff(cap=self.settings.backoff_cap_s, base=self.settings.backoff_base_s)
        failures = 0
        while not self._stop.is_set():
            headers = {"content-type": "application/json", **signed_headers(self._key, ev.id, body)}
            wait_at_least = 0.0
            try:
                resp = self._http.post(self.settings.url, content=body, headers=headers)
                if 200 <= resp.status_code < 300:
                    return True
                if resp.status_code == 410:
                    raise EndpointGone(f"{self.settings.url} answered 410 Gone to event {ev.id}: stopping")
                if resp.status_code in THROTTLE_STATUSES:
                    wait_at_least = _retry_after_s(resp.headers.get("retry-after"), self.settings.backoff_cap_s)
                why = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
            delay = max(backoff.compute(failures), wait_at_least)
            failures += 1
            with self.stats.lock:
                self.stats.failed_attempts += 1
            (log.warning if failures >= 5 else log.debug)("event %s attempt %d failed (%s); next in %.2fs",
                                                          ev.id, failures, why, delay)
            self._stop.wait(delay)
        return False


def _retry_after_s(value: str | None, cap_s: float) -> float:
    """``Retry-After`` in seconds (delta-seconds form; an HTTP date counts as nothing), at most ``cap_s``."""
    try:
        return min(max(float(value), 0.0), cap_s) if value else 0.0
    except ValueError:
        return 0.0


def _id_tuple(entry_id: Any) -> tuple[int, int]:
    """A stream id as (ms, seq), comparable; None or garbage is (0, 0)."""
    try:
        ms, _, seq = as_str(entry_id).partition("-")
        return int(ms), int(seq or 0)
    except (TypeError, ValueError, AttributeError):
        return 0, 0


def _group_entries(reply: Any) -> list[tuple[str, Any]]:
    """(id, fields) of an XREADGROUP reply on the one events stream (RESP2 list or RESP3 dict)."""
    if isinstance(reply, dict):
        reply = list(reply.items())
    if not reply:
        return []
    return [(as_str(entry_id), fields) for entry_id, fields in reply[0][1]]
