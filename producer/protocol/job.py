"""The job hash ``ps:job:{<id>}``: its fields, who writes them, and the Lua that touches them.

This module alone spells the hash's field names (``tests/test_layout.py`` checks it); the client,
the worker and the bulk sink read and write the hash through the helpers and scripts here, the
way rq's ``Job`` owns its hash. Every writing helper takes the pipeline (or ``SlotBatch``) to
queue its commands on; nothing here executes a pipeline.

Life of a job hash:

- submit (``SUBMIT_LUA``; on a cluster ``RESERVE_LUA`` then the XADD then ``CLAIM_ENTRY_LUA``):
  status queued, lane, entry_id (+ entry_lane on a cluster), created_at, result_ttl_s;
- a worker's intake reads status and cancel_requested (``queue_intake_read``; on a cluster
  ``WORKER_CLAIM_LUA``, which also settles which entry is the job's own);
- the worker starts it (``queue_start``): status running, worker, started_at, deliveries;
- the job ends (``queue_final``): status, result (``JobResult`` JSON), finished_at; a bulk job's
  hash is closed by the bulk sink instead (``queue_bulk_done``: status, bulk_id);
- a cancel (``CANCEL_LUA``) sets cancel_requested, and ends a job that is still queued.
"""
from __future__ import annotations

from typing import Any

from pagestream.producer.protocol.events import EventField, EventType
from pagestream.producer.protocol.schema import JobStatus
from pagestream.producer.protocol.wire import END_TYPE, JOB_FIELD, TYPE_FIELD, as_str

__all__ = ["JobField", "JobStatus", "FIELDS"]


class JobField:
    """The field names of the job hash."""

    STATUS = "status"  # a JobStatus value
    LANE = "lane"
    ENTRY_ID = "entry_id"  # the lane entry that runs the job (the first one named wins)
    ENTRY_LANE = "entry_lane"  # the lane shard holding that entry (Redis Cluster)
    CREATED_AT = "created_at"
    RESULT_TTL_S = "result_ttl_s"
    CANCEL_REQUESTED = "cancel_requested"  # when a cancel was asked for (epoch seconds)
    RESULT = "result"  # the JobResult JSON, once final
    FINISHED_AT = "finished_at"
    WORKER = "worker"  # the consumer running it
    STARTED_AT = "started_at"
    DELIVERIES = "deliveries"
    BULK_ID = "bulk_id"  # a bulk job's bulk, written when its part is durable


F = JobField
#: every field of the job hash
FIELDS: tuple[str, ...] = tuple(v for k, v in vars(JobField).items() if k.isupper())

_FINAL = ", ".join(f"'{s.value}'" for s in JobStatus if s.is_final)

E = EventField

# KEYS: job hash, lane stream, events stream (single node: the event is written by this script).
# ARGV: job json, lane, created_at, result_ttl_s, key TTL while queued, job id, model, events maxlen
SUBMIT_LUA = f"""
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {{0, redis.call('HGET', KEYS[1], '{F.ENTRY_ID}') or ''}}
end
local id = redis.call('XADD', KEYS[2], '*', '{JOB_FIELD}', ARGV[1])
redis.call('HSET', KEYS[1], '{F.STATUS}', '{JobStatus.QUEUED.value}', '{F.LANE}', ARGV[2], '{F.ENTRY_ID}', id,
           '{F.CREATED_AT}', ARGV[3], '{F.RESULT_TTL_S}', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
if KEYS[3] then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*', '{E.TYPE}', '{EventType.QUEUED.value}', '{E.JOB}', ARGV[6],
             '{E.TS}', ARGV[3], '{E.MODEL}', ARGV[7], '{E.LANE}', ARGV[2])
end
return {{1, id}}
"""

# KEYS: job hash, out stream, cancel stream, events stream (the last two: single node only).
# ARGV: job id, result json (if still queued), now, events maxlen.
# Returns false for an unknown job, else {status before, lane}: on a cluster the caller writes the
# `cancelled` event of a job that was queued (the events stream is in another slot).
CANCEL_LUA = f"""
local final = {{}}
for _, s in ipairs({{{_FINAL}}}) do final[s] = true end
local st, lane = unpack(redis.call('HMGET', KEYS[1], '{F.STATUS}', '{F.LANE}'))
if not st then return false end
lane = lane or ''
if final[st] then return {{st, lane}} end
redis.call('HSET', KEYS[1], '{F.CANCEL_REQUESTED}', ARGV[3])
if st == '{JobStatus.QUEUED.value}' then
  local ttl = tonumber(redis.call('HGET', KEYS[1], '{F.RESULT_TTL_S}') or '86400')
  redis.call('HSET', KEYS[1], '{F.STATUS}', '{JobStatus.CANCELLED.value}', '{F.RESULT}', ARGV[2], '{F.FINISHED_AT}', ARGV[3])
  redis.call('XADD', KEYS[2], '*', '{TYPE_FIELD}', '{END_TYPE}', 'status', '{JobStatus.CANCELLED.value}')
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
  if KEYS[4] then
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', '{E.TYPE}', '{EventType.CANCELLED.value}', '{E.JOB}', ARGV[1],
               '{E.TS}', ARGV[3], '{E.LANE}', lane)
  end
end
if KEYS[3] then  -- on a cluster the cancel stream is in another slot: the caller XADDs it next
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', '10000', '*', 'job_id', ARGV[1])
end
return {{st, lane}}
"""

# Redis Cluster: the job hash and the lane shard are in different slots, so a submit is three
# steps, each in one slot, ordered so a crash anywhere keeps "accepted once XADD returned" and
# at most one entry runs per job (RELIABILITY.md, "Redis Cluster"):
#   1. RESERVE (job slot): a job whose hash names its entry already is a no-op; else the hash
#      is written as queued (without an entry) before anything is queued, so a worker reading
#      the entry always finds it. A half-done submit (hash, no entry) goes on to step 2.
#   2. XADD to the lane shard (the shard's slot).
#   3. SETTLE (job slot): the first entry named in the hash wins (HSETNX). A worker that reads an
#      entry before step 3 names it the same way (WORKER_CLAIM_LUA), so a retried submit whose
#      earlier XADD survived a crash leaves a second entry that loses, and is deleted here or acked
#      unrun by the worker that reads it.
# KEYS: job hash. ARGV: lane, created_at, result_ttl_s, key TTL while queued
RESERVE_LUA = f"""
local st, e = unpack(redis.call('HMGET', KEYS[1], '{F.STATUS}', '{F.ENTRY_ID}'))
if e then return {{0, e}} end
if st then
  if st ~= '{JobStatus.QUEUED.value}' then return {{0, ''}} end
  return {{1, ''}}
end
redis.call('HSET', KEYS[1], '{F.STATUS}', '{JobStatus.QUEUED.value}', '{F.LANE}', ARGV[1], '{F.CREATED_AT}', ARGV[2],
           '{F.RESULT_TTL_S}', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {{1, ''}}
"""

# KEYS: job hash. ARGV: entry id, lane key (keys.lane_key). Returns {won 1/0, entry id, lane key} of the
# job's entry. Used by the producer (step 3 above).
CLAIM_ENTRY_LUA = f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return {{0, '', ''}} end
if redis.call('HSETNX', KEYS[1], '{F.ENTRY_ID}', ARGV[1]) == 1 then
  redis.call('HSET', KEYS[1], '{F.ENTRY_LANE}', ARGV[2])
  return {{1, ARGV[1], ARGV[2]}}
end
local e, l = unpack(redis.call('HMGET', KEYS[1], '{F.ENTRY_ID}', '{F.ENTRY_LANE}'))
l = l or ''
if e == ARGV[1] and l == ARGV[2] then return {{1, e, l}} end
return {{0, e, l}}
"""

# KEYS: job hash. ARGV: entry id, lane key. A job's state for a worker's intake, and whether this
# entry is the job's one entry: the first entry named in the hash wins, by the producer's settle
# step or here, whichever comes first. Returns {status, cancel_requested, won}.
WORKER_CLAIM_LUA = f"""
local st, cr, e, l = unpack(redis.call('HMGET', KEYS[1], '{F.STATUS}', '{F.CANCEL_REQUESTED}', '{F.ENTRY_ID}', '{F.ENTRY_LANE}'))
local won = 1
if st then
  if not e then
    redis.call('HSET', KEYS[1], '{F.ENTRY_ID}', ARGV[1], '{F.ENTRY_LANE}', ARGV[2])
  elseif e ~= ARGV[1] or (l or '') ~= ARGV[2] then
    won = 0
  end
end
return {{st or '', cr or '', won}}
"""

#: the producer's scripts, registered by name on its client (producer.client)
SCRIPTS = {"submit": SUBMIT_LUA, "cancel": CANCEL_LUA, "reserve": RESERVE_LUA, "claim": CLAIM_ENTRY_LUA}

#: what ``result`` reads: the result JSON (None until final) and the status (None: no such job)
RESULT_READ = [F.RESULT, F.STATUS]
#: what a worker's intake reads before it runs a job
INTAKE_READ = [F.STATUS, F.CANCEL_REQUESTED]


def status_of(raw: Any) -> JobStatus | None:
    """The ``JobStatus`` of a raw status field (None: the job has no hash)."""
    return JobStatus(as_str(raw)) if raw else None


def queue_intake_read(pipe: Any, job_hash: str) -> None:
    """Queue the read of (status, cancel_requested) that a worker does before running a job."""
    pipe.hmget(job_hash, INTAKE_READ)


def queue_start(pipe: Any, job_hash: str, worker: str, started_at: float, deliveries: int) -> None:
    """The job runs now on ``worker`` (its ``deliveries``-th delivery)."""
    pipe.hset(job_hash, mapping={F.STATUS: JobStatus.RUNNING.value, F.WORKER: worker, F.STARTED_AT: repr(started_at),
                                 F.DELIVERIES: deliveries})


def queue_final(pipe: Any, job_hash: str, status: JobStatus, result_json: str, finished_at: float | None) -> None:
    """The job's final status and result (the caller writes the end entry in the same transaction)."""
    pipe.hset(job_hash, mapping={F.STATUS: status.value, F.RESULT: result_json, F.FINISHED_AT: repr(finished_at)})


def queue_bulk_done(pipe: Any, job_hash: str, ok: bool, bulk_id: str) -> None:
    """A bulk job whose result is in a durable part: completed or failed, naming its bulk."""
    status = JobStatus.COMPLETED if ok else JobStatus.FAILED
    pipe.hset(job_hash, mapping={F.STATUS: status.value, F.BULK_ID: bulk_id})


def decode(raw: dict) -> dict[str, str]:
    """An HGETALL reply of the job hash as text (undecodable bytes replaced)."""
    return {as_str(k, "replace"): as_str(v, "replace") for k, v in raw.items()}
