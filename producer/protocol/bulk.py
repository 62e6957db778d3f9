"""The bulk hash ``ps:bulk:{<id>}``: its fields, its status enum, the spec it stores, and its Lua.

This module alone spells the hash's field names (``tests/test_layout.py`` checks it). The bulk
API and orchestrator (producer.bulk), the gateway's batches and the worker's bulk sink and gate
read and write it with these names and scripts.
"""
from __future__ import annotations

import json
import time
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.events import EventField, EventType, bulk_progress_fields, events_maxlen, queue_event
from pagestream.producer.protocol.schema import Lane
from pagestream.producer.protocol.wire import as_str

#: how boto3 addresses a bucket: "path" for most MinIO / moto set-ups, "virtual" for AWS
AddressingStyle = Literal["auto", "virtual", "path"]


class BulkField:
    """The field names of the bulk hash."""

    SPEC = "spec"  # the BulkSpec JSON
    STATUS = "status"  # a BulkStatus value
    CREATED_AT = "created_at"
    FINISHED_AT = "finished_at"
    ERROR = "error"
    RQ_JOB_ID = "rq_job_id"
    RESTARTS = "restarts"
    HEARTBEAT_AT = "heartbeat_at"
    CANCEL_REQUESTED = "cancel_requested"
    # the feed's checkpoint
    LINE = "line"
    OFFSET = "offset"
    INPUT_DONE = "input_done"
    ENDPOINT = "endpoint"
    TENANT = "tenant"  # who created it through the gateway (producer.protocol.tenants); absent: made outside it
    # counts
    SUBMITTED = "submitted"
    INVALID = "invalid"
    COMPLETED = "completed"
    FAILED = "failed"
    SKIPPED = "skipped"
    # the bulk sink's part-write errors
    SINK_ERROR = "sink_error"
    SINK_ERROR_PERMANENT = "sink_error_permanent"
    # finalize
    FINALIZE_PARTS = "finalize_parts"
    FINAL_STATUS = "final_status"
    FINAL_COUNTS = "final_counts"
    MANIFEST = "manifest"


B = BulkField
#: every field of the bulk hash
FIELDS: tuple[str, ...] = tuple(v for k, v in vars(BulkField).items() if k.isupper())


class BulkStatus(str, Enum):
    """OpenAI Batch statuses."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_final(self) -> bool:
        return self in (BulkStatus.COMPLETED, BulkStatus.FAILED, BulkStatus.CANCELLED, BulkStatus.EXPIRED)


class BulkSpec(BaseModel):
    """What a bulk was asked to do; stored as JSON in the status hash's ``spec`` field."""

    # becomes part of key names, a hash tag and every job id: no braces, no whitespace
    bulk_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,63}$")
    input: str
    output: str
    model: str | None = None
    lane: Lane = Lane.LOW
    shard_lines: int = Field(10_000, ge=1)
    max_outstanding: int = Field(2_048, ge=1)
    completion_window_s: float | None = Field(None, gt=0)
    # where the bulk's S3 objects are, for every process that touches them (never credentials)
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_addressing_style: AddressingStyle | None = None
    job_result_ttl_s: int = Field(3_600, ge=1)
    created_at: float = Field(default_factory=time.time)
    # set by the gateway's /v1/batches: what OpenAI's Batch object reports (producer.bulk.batches)
    endpoint: str | None = None  # lines with another url become error lines
    input_file_id: str | None = None
    metadata: dict[str, str] | None = None
    # set by the gateway's /v1/batches: a line whose model (after ``model``) no live worker announces,
    # or that names none, is an error line at once (chat's 404 model_not_found), never a job no worker takes
    served_models_only: bool = False
    # vLLM run-batch's --enable-auto-tool-choice --tool-call-parser NAME: how ``tool_choice: auto`` lines' output is
    # read as calls (the gateway's /v1/batches passes its own setting); None: an auto line is an error line
    tool_call_parser: str | None = None

    @property
    def batch_id(self) -> str | None:
        """The Batch API batch this bulk is (a batch's id is its bulk id), None for a plain bulk."""
        return self.bulk_id if self.input_file_id is not None else None

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, v: str | None) -> str | None:
        from pagestream.producer.protocol.tool_parsers import known_parser

        return known_parser(v)


def decode(raw: dict) -> dict[str, str]:
    """An HGETALL reply of the bulk hash as text."""
    return {as_str(k): as_str(v) for k, v in raw.items()}


def request_counts(state: dict[str, Any]) -> dict[str, int]:
    """OpenAI's ``request_counts`` from a status hash: input lines, done OK, failed (bad lines included)."""
    if state.get(B.FINAL_COUNTS):
        return json.loads(state[B.FINAL_COUNTS])
    invalid = int(state.get(B.INVALID, 0) or 0)
    submitted = int(state.get(B.SUBMITTED, 0) or 0)
    return {
        "total": submitted + invalid,
        "completed": int(state.get(B.COMPLETED, 0) or 0),
        "failed": int(state.get(B.FAILED, 0) or 0) + invalid,
    }


def read_status(conn: Any, bulk_hash: str) -> BulkStatus | None:
    """The bulk's status (None: no such bulk)."""
    raw = conn.hget(bulk_hash, B.STATUS)
    return BulkStatus(as_str(raw)) if raw is not None else None


def is_live(conn: Any, bulk_hash: str) -> bool:
    """False once a bulk is final or cancelling: a worker may skip (or drop results of) its queued jobs."""
    st = read_status(conn, bulk_hash)
    return st is not None and not (st.is_final or st == BulkStatus.CANCELLING)


_FINAL = " or ".join(f"st == '{s.value}'" for s in BulkStatus if s.is_final)

# KEYS: lease, status hash. ARGV: token, lease ms. An expired lease (Redis was away longer than
# the lease) is taken back only if nobody took it and the bulk is not final.
REFRESH_LEASE_LUA = f"""
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if holder then return 0 end
local st = redis.call('HGET', KEYS[2], '{B.STATUS}')
if {_FINAL} then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

E = EventField

# KEYS: bulk hash, done set, events stream (single node only; on a cluster it is in another slot and the caller
# writes the event from the counts returned). ARGV: ts, events maxlen, bulk id, batch id ('' for none), lines
# submitted, invalid lines, then custom_id, ok(1/0), custom_id, ok, ... Each custom_id is counted once (the done
# set), as completed or failed, when its part is durable (worker.bulk_sink); the orchestrator counts the lines it
# submitted and the invalid ones it wrote to a part of its own. When the script changed what is done (a line counted,
# or invalid lines), it writes one ``bulk_progress`` event with the counts after the change (producer.protocol.events).
# Returns {completed, failed, event written 1/0, done, failed + invalid, total}.
COUNT_LUA = f"""
local completed, failed = 0, 0
for i = 7, #ARGV, 2 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    if ARGV[i + 1] == '1' then completed = completed + 1 else failed = failed + 1 end
  end
end
local submitted, invalid = tonumber(ARGV[5]), tonumber(ARGV[6])
if completed > 0 then redis.call('HINCRBY', KEYS[1], '{B.COMPLETED}', completed) end
if failed > 0 then redis.call('HINCRBY', KEYS[1], '{B.FAILED}', failed) end
if submitted > 0 then redis.call('HINCRBY', KEYS[1], '{B.SUBMITTED}', submitted) end
if invalid > 0 then redis.call('HINCRBY', KEYS[1], '{B.INVALID}', invalid) end
if completed + failed + invalid == 0 then return {{completed, failed, 0, 0, 0, 0}} end
local c = redis.call('HMGET', KEYS[1], '{B.COMPLETED}', '{B.FAILED}', '{B.INVALID}', '{B.SKIPPED}', '{B.SUBMITTED}')
local n = {{}}
for i = 1, 5 do n[i] = tonumber(c[i] or '0') or 0 end
local done, bad, total = n[1] + n[2] + n[3] + n[4], n[2] + n[3], n[5] + n[3]
if KEYS[3] then
  local ev = {{'XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', '{E.TYPE}', '{EventType.BULK_PROGRESS.value}', '{E.JOB}', '',
              '{E.TS}', ARGV[1], '{E.BULK}', ARGV[3]}}
  if ARGV[4] ~= '' then
    table.insert(ev, '{E.BATCH}')
    table.insert(ev, ARGV[4])
  end
  for _, kv in ipairs({{{{'{E.DONE}', done}}, {{'{E.FAILED}', bad}}, {{'{E.TOTAL}', total}}}}) do
    table.insert(ev, kv[1])
    table.insert(ev, string.format('%d', kv[2]))
  end
  redis.call(unpack(ev))
end
return {{completed, failed, 1, done, bad, total}}
"""


def count_args(ts: float, maxlen: int, bulk_id: str, batch_id: str | None, submitted: int = 0, invalid: int = 0,
               lines: list[tuple[str, bool]] = ()) -> list[str]:
    """``COUNT_LUA``'s ARGV: (custom_id, ok) per line of a durable part; ``submitted`` / ``invalid`` from the feed."""
    args = [repr(float(ts)), str(maxlen), bulk_id, batch_id or "", str(submitted), str(invalid)]
    for custom_id, ok in lines:
        args += [custom_id or "", "1" if ok else "0"]
    return args


def count_keys(bulk_id: str, cluster: bool) -> list[str]:
    """``COUNT_LUA``'s KEYS: the bulk's hash and done set, and the events stream on a single node (on a cluster it is
    in another slot, and ``progress_after_count`` writes the event)."""
    return [keys.bulk_hash(bulk_id), keys.bulk_done_set(bulk_id)] + ([] if cluster else [keys.events_stream()])


def progress_after_count(conn: Any, cluster: bool, counted: list, bulk_id: str, ts: float, batch: str | None) -> None:
    """On a cluster, the ``bulk_progress`` event ``COUNT_LUA`` could not write, from the counts it returned (``counted``),
    just after it; nothing on a single node (the script wrote it) or when the script changed no count."""
    if cluster and int(counted[2]):
        done, failed, total = (int(v) for v in counted[3:6])
        queue_event(conn, bulk_progress_fields(bulk_id, ts, done, failed, total, batch), events_maxlen())


# KEYS: bulk hash, done set. ARGV: custom_ids. Counted only while the bulk is cancelling:
# a final bulk has dropped its done set, and SADD would bring it back without a TTL.
SKIP_LUA = f"""
if redis.call('HGET', KEYS[1], '{B.STATUS}') ~= '{BulkStatus.CANCELLING.value}' then return 0 end
local n = 0
for i = 1, #ARGV do
  n = n + redis.call('SADD', KEYS[2], ARGV[i])
end
if n > 0 then redis.call('HINCRBY', KEYS[1], '{B.SKIPPED}', n) end
return n
"""
