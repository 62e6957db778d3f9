"""One blocking XREAD for every job stream an ``AsyncProducer`` waits on (``multiplex_reads=True``).

A process that follows many jobs at once (the gateway: one per open stream or
waiting request) would otherwise hold one connection in ``XREAD BLOCK`` per job and
pay a command (pack, pool checkout, parse) per job per wake. Here one reader task
reads every subscribed job stream in one ``XREAD BLOCK ... STREAMS k1 .. kn id1 .. idn``
and hands each subscriber its entries; the producer core's ``stream`` and ``result``
run unchanged on top (their ``xread`` calls are answered from here, in redis-py's
shape), so dedup, resume, timeouts and reconnects behave as before.

A key subscribed while the reader is blocked on an older key set rings the
process's wake stream (``keys.stream_mux_wake``), which the reader always reads
too, so the new key joins at once; as a stream, a ring sent before the reader's
XREAD reaches Redis is not lost. Single node only: on a Redis Cluster each job's
stream is in its own slot, and one XREAD cannot span slots.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from redis.backoff import ExponentialBackoff

from pagestream.producer.protocol import keys
from pagestream.producer.client.aio import cancel_until_done
from pagestream.producer.client.core import Failed

log = logging.getLogger(__name__)

#: the reader's XREAD BLOCK; changes to the key set ring the wake stream, so this only bounds an idle read
READ_BLOCK_MS = 1000
#: entries read per stream per XREAD (a job's events since the last read are usually a few)
READ_COUNT = 1000
#: seconds a wake stream outlives its last ring (a gateway that died leaves it only this long)
WAKE_TTL_S = 3600


def _id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


class _Sub:
    """One operation's view of one stream: entries read for it and not yet handed out."""

    __slots__ = ("key", "position", "delivered", "buffer", "waiter")

    def __init__(self, key: str, after: tuple[int, int]) -> None:
        self.key = key
        self.position = after  # id of the last entry put in the buffer
        self.delivered = after  # id of the last entry handed to the operation
        self.buffer: list = []
        self.waiter: asyncio.Future | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class StreamMux:
    """Answers blocking single-stream XREADs of many operations from one shared XREAD."""

    def __init__(self, client: Any) -> None:
        self.redis = client
        self.wake_key = keys.stream_mux_wake(uuid.uuid4().hex)
        self._subs: dict[str, set[_Sub]] = {}  # stream key -> its subscribers
        self._wake_id = "0-0"
        self._reader: asyncio.Task | None = None
        self._reading: dict[str, tuple[int, int]] | None = None  # key -> id the XREAD in flight reads after
        self._ringing = False
        self._background: set[asyncio.Task] = set()
        self.error: Exception | None = None  # the reader's last failure, until a read succeeds
        self._closed = False
        self.num_reads = 0

    # -- what AsyncProducer calls ---------------------------------------------------------

    async def read(self, owner: dict[str, _Sub], key: str, last_id: str, count: int | None, block_ms: int | None) -> Any:
        """``XREAD COUNT count BLOCK block_ms STREAMS key last_id`` for one operation (``owner``:
        its subscriptions, released with ``release``). Returns redis-py's reply shape, ``[]`` when
        nothing came within the block, or ``Failed`` while the shared reader cannot reach Redis."""
        after = _id(last_id)
        sub = owner.get(key)
        if sub is None or sub.delivered != after:
            if sub is not None:
                self._unsubscribe(sub)
            sub = owner[key] = self._subscribe(key, after)
        if not sub.buffer and self.error is None:
            loop = asyncio.get_running_loop()
            sub.waiter = loop.create_future()
            timer = loop.call_later((block_ms or READ_BLOCK_MS) / 1000, sub.wake)
            try:
                await sub.waiter
            finally:
                timer.cancel()
                sub.waiter = None
        if not sub.buffer:
            return Failed(self.error) if self.error is not None else []
        n = count or len(sub.buffer)
        out, sub.buffer = sub.buffer[:n], sub.buffer[n:]
        sub.delivered = _id(out[-1][0])
        return [[key, out]]

    def release(self, owner: dict[str, _Sub]) -> None:
        """An operation ended: drop its subscriptions."""
        for sub in owner.values():
            self._unsubscribe(sub)
        owner.clear()

    async def aclose(self) -> None:
        self._closed = True
        for task in [t for t in (self._reader, *self._background) if t is not None]:
            await cancel_until_done(task)
        try:
            await self.redis.delete(self.wake_key)
        except Exception:  # closing: a Redis that is gone keeps the key until its TTL
            pass

    # -- subscriptions ------------------------------------------------------------------------

    def _subscribe(self, key: str, after: tuple[int, int]) -> _Sub:
        sub = _Sub(key, after)
        self._subs.setdefault(key, set()).add(sub)
        if self._reader is None or self._reader.done():
            self.error = None  # an earlier reader's failure says nothing about Redis now: the new one finds out
            self._reader = asyncio.get_running_loop().create_task(self._run(), name="pagestream-stream-mux")
        elif self._reading is not None and self._reading.get(key, (1 << 62, 0)) > after:
            # the XREAD in flight does not read this key (or not from this far back): make it return
            self._ring()
        return sub

    def _unsubscribe(self, sub: _Sub) -> None:
        subs = self._subs.get(sub.key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.key]
        sub.wake()

    def _ring(self) -> None:
        if self._ringing:
            return  # one ring per XREAD is enough: the next one reads every key subscribed by then
        self._ringing = True
        t = asyncio.get_running_loop().create_task(self._send_ring())
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def _send_ring(self) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
            pipe.expire(self.wake_key, WAKE_TTL_S)
            await pipe.execute()
        except Exception as exc:  # the reader meets the same failure and retries; its next XREAD has every key
            log.debug("stream mux: ring failed: %s", exc)

    # -- the reader -------------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = ExponentialBackoff(cap=2.0, base=0.05)
        failures = 0
        while self._subs and not self._closed:
            reading: dict[str, tuple[int, int]] = {}
            for key, subs in self._subs.items():
                reading[key] = min(s.position for s in subs)
            streams: dict[str, str] = {self.wake_key: self._wake_id}
            streams.update((k, f"{ms}-{seq}") for k, (ms, seq) in reading.items())
            self._reading, self._ringing = reading, False
            try:
                reply = await self.redis.xread(streams, count=READ_COUNT, block=READ_BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away (or a bug): every waiter gets Failed, the core backs off
                self._reading = None
                self.error = exc
                for subs in self._subs.values():
                    for s in subs:
                        s.wake()
                failures += 1
                log.debug("stream mux: XREAD failed (%s), retrying", exc)
                await asyncio.sleep(backoff.compute(failures))
                continue
            self._reading = None
            self.error = None
            failures = 0
            self.num_reads += 1
            self._dispatch(reply or [])

    def _dispatch(self, reply: list) -> None:
        for raw_key, entries in reply:
            if not entries:
                continue
            key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
            if key == self.wake_key:
                self._wake_id = entries[-1][0].decode() if isinstance(entries[-1][0], bytes) else entries[-1][0]
                continue
            first = _id(entries[0][0])
            for sub in self._subs.get(key, ()):
                # ids only grow, so a subscriber at or before the first entry takes them all
                fresh = entries if first > sub.position else [e for e in entries if _id(e[0]) > sub.position]
                if fresh:
                    sub.buffer.extend(fresh)
                    sub.position = _id(fresh[-1][0])
                    sub.wake()
