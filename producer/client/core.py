"""What a producer does, written once for ``Producer`` and ``AsyncProducer``.

Each operation is a generator that yields the Redis work it needs (``Call``,
``Sleep``) and receives the reply; ``stream`` also yields ``Emit`` for each token
event. The sync client drives these generators with redis-py, the async one with
redis.asyncio: the two differ only in how a ``Call`` is performed and how they
sleep, so submit, result, stream, cancel and their retries cannot drift apart.

Connection errors on read-only calls (``retry=True``) come back as a ``Failed``
reply instead of raising, so a subscriber rides out a Redis restart: it backs
off (redis-py's ``ExponentialBackoff``), reconnects and resumes reading after
the last entry it delivered.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import ExponentialBackoff

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.events import EventType, event_fields, events_maxlen
from pagestream.producer.protocol.job import RESULT_READ, SCRIPTS, JobField
from pagestream.producer.protocol.lanes import SINGLE, LaneLayout, layout_args
from pagestream.producer.protocol.redis_conn import queue_script
from pagestream.producer.protocol.schema import JobRequest, JobResult, JobStatus, TokenEvent
from pagestream.producer.protocol.wire import JOB_FIELD, EventDeduper, as_str, decode_out_entry, end_summary, is_end_entry, job_fields

#: how long a queued job's hash lives when the job has no deadline: a job that no worker ever
#: starts (or whose worker dies unreclaimed) does not leave keys forever. A worker sets the
#: key's TTL again when it starts the job and when it ends it.
QUEUED_JOB_KEY_TTL_S = 7 * 24 * 3600


def call_script(script: Any, keys_: list, args: list, client: Any) -> Any:
    """Run a registered script on ``client``. A cluster pipeline cannot load a script it lacks
    (redis-py queues EVALSHA and the NOSCRIPT comes back at execute), so there it is sent whole."""
    from redis.asyncio.cluster import ClusterPipeline as AsyncClusterPipeline
    from redis.cluster import ClusterPipeline

    if isinstance(client, (ClusterPipeline, AsyncClusterPipeline)):
        return queue_script(client, "EVAL", script.script, keys_, args)
    return script(keys=keys_, args=args, client=client)


#: doorbell entries kept (keys.lane_bell); a worker only needs the newest id
BELL_MAXLEN = 1000

#: errors after which a read is retried (Redis restarting, a failover, a dropped connection)
TRANSIENT_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class JobNotFound(KeyError):
    """No job with this id (never submitted, or its result TTL passed)."""


class ModelNotServed(ValueError):
    """A job names a model no live worker announced (submit with ``queue_unserved=True`` to queue it anyway)."""

    def __init__(self, model: str, served: list[str]) -> None:
        self.model = model
        self.served = served
        super().__init__(
            f"no worker serves model {model!r} (served now: {served or 'none'}); "
            "start a worker for it, or submit with queue_unserved=True to queue the job until one does"
        )


@dataclass(frozen=True, slots=True)
class Call:
    """One Redis command (``method`` of the client) or registered script (``script``)."""

    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    retry: bool = False  # read-only: a connection error comes back as Failed instead of raising
    script: bool = False  # ``method`` names one of SCRIPTS, registered on the client
    on: Any = None  # a pipeline to call ``method`` on instead of the client


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Emit:
    event: TokenEvent


@dataclass(frozen=True, slots=True)
class Failed:
    error: Exception


Steps = Generator[Any, Any, Any]


def build_request(request: JobRequest | dict | None = None, **fields: Any) -> JobRequest:
    # Keywords left at None (submit's prompt=None, messages=None, job_id=None) were not given.
    fields = {k: v for k, v in fields.items() if v is not None}
    if request is None:
        return JobRequest(**fields)
    if isinstance(request, dict):
        return JobRequest.model_validate({**request, **fields})
    if fields:
        raise TypeError("pass either a JobRequest or keyword fields, not both")
    return request


def queued_key_ttl_s(job: JobRequest) -> int:
    """TTL of a queued job's hash: its result TTL past the end of its queueing window (its
    deadline, else ``QUEUED_JOB_KEY_TTL_S``)."""
    window = job.deadline - job.created_at if job.deadline is not None else QUEUED_JOB_KEY_TTL_S
    return int(max(window, 0)) + job.result_ttl_s + 1


def submit_script_call(job: JobRequest) -> Call:
    lane = job.lane.value
    return Call(
        "submit",
        script=True,
        kwargs={
            "keys": [keys.job_hash(job.job_id), keys.jobs_stream(lane, job.model), keys.events_stream()],
            "args": [job_fields(job)[JOB_FIELD], lane, repr(job.created_at), job.result_ttl_s, queued_key_ttl_s(job),
                     job.job_id, job.model or "", events_maxlen()],
        },
    )


def cancel_script_call(job_id: str, now: float, cluster: bool = False) -> Call:
    result = JobResult(job_id=job_id, status=JobStatus.CANCELLED, error="cancelled before it started")
    # on a cluster the cancel stream and the events stream live in other slots: ProducerCore.cancel writes them
    # after the script
    job_keys = [keys.job_hash(job_id), keys.out_stream(job_id)]
    return Call(
        "cancel",
        script=True,
        kwargs={
            "keys": job_keys if cluster else [*job_keys, keys.cancel_stream(), keys.events_stream()],
            "args": [job_id, result.model_dump_json(), repr(now), events_maxlen()],
        },
    )


def event_call(fields: dict[str, str], on: Any = None) -> Call:
    """The XADD of one event (``producer.protocol.events.queue_event``'s, as a step): on a cluster, where the events
    stream is a slot of its own and no script of the change can write it."""
    return Call("xadd", (keys.events_stream(), fields), {"maxlen": events_maxlen(), "approximate": True}, on=on)


def live_models_call(now_s: float | None = None) -> Call:
    now_ms = int((now_s if now_s is not None else time.time()) * 1000)
    return Call("zrangebyscore", (keys.model_registry(), now_ms, "+inf"))


def _block_ms(deadline: float | None, timed_out: Callable[[], str]) -> int:
    """How long a blocking read may wait (1 s at most, less as ``deadline`` nears); ``TimeoutError``
    saying ``timed_out()`` once it has passed."""
    if deadline is None:
        return 1000
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(timed_out())
    return max(1, min(1000, int(left * 1000)))


class ProducerCore:
    """State shared by one producer's operations: the served-model cache and the reconnect policy."""

    #: a model seen live is trusted this long before the registry is read again
    MODEL_CACHE_S = 1.0

    def __init__(self, reconnect_timeout_s: float = 60.0, cluster: bool = False) -> None:
        self.reconnect_timeout_s = reconnect_timeout_s
        self.cluster = cluster  # Redis Cluster: lanes are sharded and a submit is three one-slot steps
        self._live_until: dict[str, float] = {}
        self._layout: LaneLayout | None = None

    def layout(self) -> Steps:
        """The lane layout of this Redis (read once; one shard per lane on a single node)."""
        if self._layout is None:
            if not self.cluster:
                self._layout = SINGLE
            else:
                key, field_, want = layout_args()
                yield Call("hsetnx", (key, field_, want))
                self._layout = LaneLayout(int((yield Call("hget", (key, field_)))))
        return self._layout

    # -- submit ------------------------------------------------------------------------------

    def check_models(self, jobs: list[JobRequest], queue_unserved: bool) -> Steps:
        """Refuse jobs for models no live worker announced (one registry read, cached while live)."""
        if queue_unserved:
            return
        now = time.monotonic()
        wanted = {j.model for j in jobs if j.model is not None and self._live_until.get(j.model, 0.0) < now}
        if not wanted:
            return
        served = [as_str(m) for m in (yield live_models_call())]
        for m in served:
            self._live_until[m] = now + self.MODEL_CACHE_S
        for m in sorted(wanted):
            if m not in served:
                raise ModelNotServed(m, sorted(served))

    def submit(self, job: JobRequest, queue_unserved: bool, pipeline: Any = None) -> Steps:
        yield from self.check_models([job], queue_unserved)
        if self.cluster:
            if pipeline is not None:
                raise ValueError("on Redis Cluster a submit cannot join a caller's pipeline: it takes three steps in two "
                                 "hash slots (see RELIABILITY.md); submit first, then run the pipeline")
            yield from self._submit_sharded([job])
            return job.job_id
        call = submit_script_call(job)
        if pipeline is not None:
            call.kwargs["client"] = pipeline
        yield call
        return job.job_id

    def submit_many(self, jobs: list[JobRequest], queue_unserved: bool) -> Steps:
        yield from self.check_models(jobs, queue_unserved)
        if self.cluster:
            yield from self._submit_sharded(jobs)
            return [j.job_id for j in jobs]
        pipe = yield Call("pipeline", kwargs={"transaction": False})
        for job in jobs:
            call = submit_script_call(job)
            call.kwargs["client"] = pipe
            yield call
        yield Call("execute", on=pipe)
        return [j.job_id for j in jobs]

    def _submit_sharded(self, jobs: list[JobRequest]) -> Steps:
        """Reserve, XADD, settle (the comment above producer.protocol.job.RESERVE_LUA): three pipelined round trips for any number of jobs."""
        layout = yield from self.layout()
        pipe = yield Call("pipeline", kwargs={"transaction": False})
        for job in jobs:
            yield Call("reserve", script=True, kwargs={"client": pipe, "keys": [keys.job_hash(job.job_id)], "args": [
                job.lane.value, repr(job.created_at), job.result_ttl_s, queued_key_ttl_s(job)]})
        reserved = yield Call("execute", on=pipe)
        todo = [job for job, (fresh, _) in zip(jobs, reserved) if int(fresh) == 1]
        if not todo:
            return
        placed = []
        pipe = yield Call("pipeline", kwargs={"transaction": False})
        for job in todo:
            lane_key = keys.lane_key(job.lane.value, layout.shard_of(job.job_id))
            stream = layout.stream(lane_key, job.model)
            placed.append((job, lane_key, stream))
            yield Call("xadd", (stream, {JOB_FIELD: job_fields(job)[JOB_FIELD]}), on=pipe)
        entry_ids = yield Call("execute", on=pipe)
        pipe = yield Call("pipeline", kwargs={"transaction": False})
        for (job, lane_key, _), entry_id in zip(placed, entry_ids):
            yield Call("claim", script=True, kwargs={"client": pipe, "keys": [keys.job_hash(job.job_id)],
                                                     "args": [as_str(entry_id), lane_key]})
        # The events stream is a slot of its own: each job's `queued` event goes with its settle, in the same
        # round trip. Only a job this attempt reserved fresh gets here, and an earlier attempt that reached its
        # settle left the hash naming an entry (no reservation then), so a job is reported queued at most once.
        for job, _, _ in placed:
            yield event_call(event_fields(EventType.QUEUED, job.job_id, job.created_at, model=job.model or "",
                                          lane=job.lane.value), on=pipe)
        # ring the idle workers' doorbell once the entries are in (after their XADD round trip),
        # naming the shards, so a woken worker reads those instead of every shard
        for model in sorted({job.model or "" for job, _, _ in placed}):
            shards = sorted({lane_key for job, lane_key, _ in placed if (job.model or "") == model})
            yield Call("xadd", (keys.lane_bell(), {"model": model, "lanes": ",".join(shards)}),
                       {"maxlen": BELL_MAXLEN, "approximate": True}, on=pipe)
        settled = (yield Call("execute", on=pipe))[:len(placed)]
        # a lost claim names the winner; none named (the hash expired meanwhile): keep the entry, a worker runs it
        losers = [(stream, as_str(eid)) for (_, _, stream), eid, (won, winner, _) in zip(placed, entry_ids, settled)
                  if not int(won) and winner]
        if losers:  # another entry of the job (an earlier attempt's) is the one that runs
            pipe = yield Call("pipeline", kwargs={"transaction": False})
            for stream, eid in losers:
                yield Call("xdel", (stream, eid), on=pipe)
            yield Call("execute", on=pipe)

    # -- reads -------------------------------------------------------------------------------

    def _read(self, call: Call | list[Call], what: str, patient: bool = True) -> Steps:
        """Perform a read, backing off and retrying on connection errors up to ``reconnect_timeout_s``.
        A list of read-only calls goes in one pipelined round trip (built afresh for each try:
        redis-py empties a pipeline whether its execute succeeded or not).

        Not ``patient`` (an operation that has not reached Redis yet): the first failure is final,
        so a command pointed at a Redis that is down says so at once instead of waiting it out.
        """
        backoff = ExponentialBackoff(cap=2.0, base=0.05)
        failures = 0
        give_up = time.monotonic() + self.reconnect_timeout_s
        while True:
            if isinstance(call, list):
                pipe = yield Call("pipeline", kwargs={"transaction": False})
                for c in call:
                    yield Call(c.method, c.args, c.kwargs, on=pipe)
                reply = yield Call("execute", on=pipe, retry=True)
            else:
                reply = yield call
            if not isinstance(reply, Failed):
                return reply
            if not patient:
                raise redis.ConnectionError(f"cannot reach Redis while {what}: {reply.error}") from reply.error
            if time.monotonic() > give_up:
                raise redis.ConnectionError(f"Redis unreachable for {self.reconnect_timeout_s} s while {what}") from reply.error
            failures += 1
            yield Sleep(backoff.compute(failures))

    def status(self, job_id: str) -> Steps:
        st = yield Call("hget", (keys.job_hash(job_id), JobField.STATUS))
        return JobStatus(as_str(st)) if st is not None else None

    def cancel(self, job_id: str) -> Steps:
        now = time.time()
        reply = yield cancel_script_call(job_id, now, self.cluster)
        if not reply:
            return None
        status, lane = JobStatus(as_str(reply[0])), as_str(reply[1])
        if self.cluster and status == JobStatus.QUEUED:
            # the script ended the job: its event, which the script could not write in the events stream's slot
            yield event_call(event_fields(EventType.CANCELLED, job_id, now, lane=lane))
        if self.cluster and not status.is_final:
            # after the job hash says cancel_requested: a worker told first could admit the job before
            # the flag is there. A crash between the two leaves the flag, which intake checks; a
            # retried cancel sends the notice again.
            yield Call("xadd", (keys.cancel_stream(), {"job_id": job_id}), {"maxlen": 10000, "approximate": True})
        return status

    def live_models(self) -> Steps:
        return sorted(as_str(m) for m in (yield live_models_call()))

    def result(self, job_id: str, timeout: float | None) -> Steps:
        deadline = None if timeout is None else time.monotonic() + timeout
        out_key = keys.out_stream(job_id)
        last: str | None = None
        what = f"waiting for job {job_id}"
        reached = False  # a reconnect is waited for only once Redis answered this call
        look = True  # read the job's hash this turn
        looked = 0.0
        while True:
            if look:
                read_result = Call("hmget", (keys.job_hash(job_id), RESULT_READ), retry=True)
                if last is None:
                    # Note the newest entry before reading the result (one round trip, in this order): the
                    # worker writes the end entry and the result in one transaction, so a result missed here
                    # has its end entry after this id and the XREAD wakes at once (read the other way round,
                    # it would sleep a full block).
                    newest, (raw, st) = yield from self._read(
                        [Call("xrevrange", (out_key,), {"count": 1}), read_result], what, reached)
                    last = as_str(newest[0][0]) if newest else "0-0"
                    reached = True
                else:
                    raw, st = yield from self._read(read_result, what)
                if raw is not None:
                    return JobResult.model_validate_json(raw)
                if st is None:
                    raise JobNotFound(job_id)
                looked = time.monotonic()
            block_ms = _block_ms(deadline, lambda: f"job {job_id} not finished after {timeout} s (status {as_str(st)})")
            # Wake as soon as the worker writes anything to the job's stream. The hash is read again when
            # the end entry shows (it and the result are written in one transaction), after a quiet block,
            # and at least each second (a Redis restarted empty loses the hash while its worker writes on),
            # not at every token event: a request waiting for 64 tokens read it ~26 times.
            resp = yield from self._read(Call("xread", ({out_key: last},), {"count": 1000, "block": block_ms}, retry=True), what)
            look = not resp or time.monotonic() - looked > 1.0
            for _, entries in resp or []:
                if entries:
                    last = as_str(entries[-1][0])
                    look = look or any(is_end_entry(f) for _, f in entries)

    def results(self, job_ids: list[str], timeout: float | None) -> Steps:
        """``result`` for many jobs at once, in the order of ``job_ids``.

        One blocking XREAD waits on every unfinished job's stream, and the results are read in
        pipelined rounds: a few round trips for the whole batch instead of a few per job. A job
        is read again when its stream shows its end entry (written in the same transaction as its
        result) and, as ``result`` does, whenever a block passes with nothing new. On Redis
        Cluster one XREAD cannot span the jobs' hash slots, so the jobs are waited for in turn.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        unique = list(dict.fromkeys(job_ids))
        got: dict[str, JobResult] = {}
        if self.cluster:
            for job_id in unique:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                got[job_id] = yield from self.result(job_id, left)
            return [got[j] for j in job_ids]
        what = f"waiting for {len(unique)} jobs"
        stream_of = {job_id: keys.out_stream(job_id) for job_id in unique}
        job_of = {stream_of[j].encode(): j for j in unique}
        last: dict[str, str] = {}
        check = unique
        reached = False  # a reconnect is waited for only once Redis answered this call
        while True:
            if check:
                # Note each stream's newest entry before reading its result, in the same round trip (the
                # reason is in ``result``).
                fresh = [j for j in check if j not in last]
                replies = yield from self._read(
                    [Call("xrevrange", (stream_of[j],), {"count": 1}) for j in fresh]
                    + [Call("hmget", (keys.job_hash(j), RESULT_READ)) for j in check], what, reached or not fresh)
                reached = True
                for j, entries in zip(fresh, replies):
                    last[j] = as_str(entries[0][0]) if entries else "0-0"
                rows = replies[len(fresh):]
                for j, (raw, st) in zip(check, rows):
                    if raw is not None:
                        got[j] = JobResult.model_validate_json(raw)
                        del last[j]
                    elif st is None:
                        raise JobNotFound(j)
            if not last:
                return [got[j] for j in job_ids]
            block_ms = _block_ms(deadline, lambda: f"{len(last)} of {len(unique)} jobs not finished after {timeout} s")
            resp = yield from self._read(Call("xread", ({stream_of[j]: i for j, i in last.items()},),
                                              {"count": 1000, "block": block_ms}, retry=True), what)
            if not resp:
                check = list(last)  # a quiet block: look at every hash again, as ``result`` does
                continue
            check = []
            for key, entries in resp:
                j = job_of[key if isinstance(key, bytes) else key.encode()]
                if entries:
                    last[j] = as_str(entries[-1][0])
                    if any(is_end_entry(f) for _, f in entries):
                        check.append(j)

    def stream(self, job_id: str, from_index: int, timeout: float | None) -> Steps:
        """Emits the job's events; returns ``(status, summary)``: the status its end entry names (None when the
        job's stream had expired before its end was read) and the completed job's summary the entry carries
        (``wire.end_summary``: usage and timings; None from an older worker)."""
        out_key = keys.out_stream(job_id)
        dedup = EventDeduper(from_index)
        last = "0-0"  # the last entry read: after a reconnect, reading resumes right after it
        idle_since = checked = time.monotonic()
        what = f"streaming job {job_id}"
        reached = False  # a reconnect is waited for only once Redis answered this call
        while True:
            resp = yield from self._read(Call("xread", ({out_key: last},), {"count": 1000, "block": 1000}, retry=True),
                                         what, reached)
            reached = True
            if not resp:
                st = yield from self._read(Call("hget", (keys.job_hash(job_id), JobField.STATUS), retry=True), what)
                exists = yield from self._read(Call("exists", (out_key,), retry=True), what)
                if st is None and not exists:
                    raise JobNotFound(job_id)
                if st is not None and JobStatus(as_str(st)).is_final and not exists:
                    return None, None
                if timeout is not None and time.monotonic() - idle_since > timeout:
                    raise TimeoutError(f"no event for job {job_id} in {timeout} s")
                continue
            idle_since = time.monotonic()
            if idle_since - checked > 1.0:
                # A Redis restarted empty under a live job: its worker goes on writing deltas to a new
                # stream, but the job's hash (written at submit, kept until its TTL) is gone for good.
                checked = idle_since
                if (yield from self._read(Call("hget", (keys.job_hash(job_id), JobField.STATUS), retry=True), what)) is None:
                    raise JobNotFound(job_id)
            for _, entries in resp:
                for entry_id, fields in entries:
                    last = as_str(entry_id)
                    ev = decode_out_entry(job_id, fields)
                    if isinstance(ev, str):
                        return ev, end_summary(job_id, fields)  # the end entry's status (and usage)
                    if dedup.accept(ev):
                        yield Emit(ev)
