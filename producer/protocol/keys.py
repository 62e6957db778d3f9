"""Every Redis key name pagestream uses, built in one place.

Keys that belong to one job share the hash tag ``{job_id}`` so all of a job's
keys land in one slot on Redis Cluster. Lane streams and the dead-letter stream
are shared by many jobs and carry no job tag. On a cluster each lane is split into
``lane_shards`` streams (``lane_stream_shards``), each under its own hash tag, so the
queue's load spreads over the masters; shard 0 is the unsharded name, so a single node
(one shard) keeps the names it always had. All keys of one bulk share the
hash tag ``{bulk_id}`` so a bulk's bookkeeping lands in one slot and the bulk
sink's Lua script may touch them together.
"""
from __future__ import annotations

from functools import lru_cache

PREFIX = "ps"

#: the consumer group every worker joins on each lane stream
DEFAULT_GROUP = "workers"

#: lanes in the order workers read them: high before normal before low
LANES: tuple[str, ...] = ("high", "normal", "low")


def jobs_stream(lane: str, model: str | None = None) -> str:
    """Stream of submitted jobs for one priority lane: the shared one, or one model's (routing by model)."""
    if model is None:
        return f"{PREFIX}:jobs:{lane}"
    return f"{PREFIX}:jobs:m:{model}:{lane}"


#: separates a lane from its shard in a "lane key" (``normal/3``): what a worker's entries name as their lane
SHARD_SEP = "/"


@lru_cache(maxsize=4096)
def shard_tag(shard: int, num_shards: int) -> str:
    """The hash tag of lane shard ``shard`` of ``num_shards``: the first ``s<shard>.<k>`` whose
    slot lies in the shard's share of the 16384 slots, so shards spread evenly over masters that
    own equal slot ranges (what ``redis-cli --cluster create`` sets up)."""
    from redis.crc import key_slot

    lo, hi = shard * 16384 // num_shards, (shard + 1) * 16384 // num_shards
    k = 0
    while True:
        tag = f"s{shard}.{k}"
        if lo <= key_slot(tag.encode()) < hi:
            return tag
        k += 1


def lane_key(lane: str, shard: int = 0) -> str:
    """What a worker calls one stream it reads: the lane name for shard 0, ``lane/shard`` otherwise."""
    return lane if shard == 0 else f"{lane}{SHARD_SEP}{shard}"


def split_lane_key(lane_key_: str) -> tuple[str, int]:
    """(lane, shard) of a ``lane_key``."""
    lane, _, shard = lane_key_.partition(SHARD_SEP)
    return lane, int(shard or 0)


def lane_stream_shards(lane: str, model: str | None = None, num_shards: int = 1) -> list[str]:
    """Every stream of one lane, shard 0 first. Shard 0 is ``jobs_stream(lane, model)``; shard
    ``i > 0`` appends ``{tag}`` (``shard_tag``), the same tag for every lane and model."""
    base = jobs_stream(lane, model)
    return [base] + [f"{base}:{{{shard_tag(i, num_shards)}}}" for i in range(1, num_shards)]


def lane_bell() -> str:
    """Stream a producer on a cluster XADDs to after queueing jobs: idle workers block on it (one key)
    instead of on one shard of many, then read every shard (``worker.consumer``)."""
    return f"{PREFIX}:jobs:bell"


def lane_layout() -> str:
    """Hash: ``lane_shards`` -> how many streams each lane has (set once per Redis, read by every process)."""
    return f"{PREFIX}:layout"


def model_registry() -> str:
    """Sorted set: model name -> unix ms until which some worker announced it serves that model."""
    return f"{PREFIX}:models"


def model_info() -> str:
    """Hash: model name -> JSON of what its workers announced (``max_model_len``, ``vocab_size``)."""
    return f"{PREFIX}:models:info"


def tokenizer_calls(model: str) -> str:
    """List: tokenizer calls (``/tokenize``, ``/detokenize``, ``/tokenizer_info``) for ``model``'s workers,
    pushed by the gateway, popped by any worker serving ``model`` (``producer.protocol.tokenization``)."""
    return f"{PREFIX}:tok:{{{model}}}:calls"


def tokenizer_reply(call_id: str) -> str:
    """List: the one reply to tokenizer call ``call_id`` (expires shortly after it is pushed)."""
    return f"{PREFIX}:tok:reply:{{{call_id}}}"


def dead_letter_stream() -> str:
    """Copies of jobs that were invalid or failed ``max_deliveries`` deliveries."""
    return f"{PREFIX}:dlq"


def cancel_stream() -> str:
    """Cancellation requests; every worker reads it (no group) to stop running jobs."""
    return f"{PREFIX}:cancels"


def job_hash(job_id: str) -> str:
    """Hash with a job's status, request, result and timings (expires after the result TTL)."""
    return f"{PREFIX}:job:{{{job_id}}}"


def out_stream(job_id: str) -> str:
    """Per-job stream of token events followed by one ``end`` event."""
    return f"{PREFIX}:out:{{{job_id}}}"


def stream_mux_wake(instance: str) -> str:
    """Stream one process's shared job-stream reader also blocks on: XADDed to when a job stream joins
    while that read is in flight (``producer.client.mux``). Short TTL, deleted on close."""
    return f"{PREFIX}:mux:{instance}"


def done_counter(lane: str, epoch_s: int) -> str:
    """Jobs finished in one wall-clock second on a lane (for jobs/s in ``pagestream stats``)."""
    return f"{PREFIX}:rate:{lane}:{epoch_s}"


def worker_hash(consumer: str) -> str:
    """A live worker's engine stats (running, free KV blocks...), refreshed every second, short TTL."""
    return f"{PREFIX}:worker:{consumer}"


def bench_stream(name: str) -> str:
    """Scratch stream ``bench/queue_overhead.py`` XADDs to for its Redis floor (deleted after each run)."""
    return f"{PREFIX}:bench:{name}"


# ---- bulk path (producer.bulk.api, producer.bulk.orchestrator, worker.bulk_sink) ----
def bulk_hash(bulk_id: str) -> str:
    """Status hash: status, spec, checkpoint (line, offset), request counts, error."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}"


def bulk_done_set(bulk_id: str) -> str:
    """custom_ids whose result is in a durable part file (counted exactly once)."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}:done"


def bulk_seen_hash(bulk_id: str) -> str:
    """custom_id -> input line that first used it (duplicate detection, resume-safe)."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}:seen"


def bulk_lock(bulk_id: str) -> str:
    """Lease of the one orchestrator running the bulk (a random token, PX expiry)."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}:lock"


def bulk_rescue_marker(bulk_id: str) -> str:
    """Short-lived marker so two bulk workers do not both re-enqueue a stalled bulk."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}:rescue"


def bulk_part_seq(bulk_id: str) -> str:
    """Counter for part file sequence numbers (unique across worker restarts)."""
    return f"{PREFIX}:bulk:{{{bulk_id}}}:partseq"


def bulk_index() -> str:
    """Sorted set of all bulk ids by creation time."""
    return f"{PREFIX}:bulks"


# ---- OpenAI files (producer.bulk.batches: /v1/files in the gateway) ----
def file_hash(file_id: str) -> str:
    """An uploaded (or batch output) file's record: name, bytes, purpose, where its content lives."""
    return f"{PREFIX}:file:{{{file_id}}}"


def files_index() -> str:
    """Sorted set of file ids by creation time."""
    return f"{PREFIX}:files"


# ---- tenants (producer.protocol.tenants: who owns a file or a batch) ----
def tenant_files_index(tenant: str) -> str:
    """Sorted set of one tenant's file ids by creation time (its ``/v1/files`` list, paginated from it)."""
    return f"{PREFIX}:files:t:{{{tenant}}}"


def tenant_bulks_index(tenant: str) -> str:
    """Sorted set of one tenant's batch (bulk) ids by creation time (its ``/v1/batches`` list)."""
    return f"{PREFIX}:bulks:t:{{{tenant}}}"


def file_tombstone(file_id: str) -> str:
    """Marks a deleted file so nothing (a batch's manifest) registers it again."""
    return f"{PREFIX}:file:{{{file_id}}}:deleted"


def events_stream() -> str:
    """The job-event firehose (``protocol/events.py``): one capped stream of lifecycle events."""
    return f"{PREFIX}:events"


def stream_record(job_id: str) -> str:
    """A streamed request's owner and body (JSON), so that any gateway can resume its stream (GET /v1/streams)."""
    return f"{PREFIX}:streamrec:{{{job_id}}}"


def response_record(response_id: str) -> str:
    """A stored ``/v1/responses`` answer (JSON: its owner, the Response object, the conversation so far), read by
    ``GET /v1/responses/{id}`` and ``previous_response_id``; it lives ``response_ttl_s``."""
    return f"{PREFIX}:response:{{{response_id}}}"


def stream_leases() -> str:
    """Sorted set of the jobs whose streams a client holds (or left less than the grace ago), scored by when
    the lease ends (ms): the serving gateway renews it while its client is connected; every gateway cancels
    the jobs whose lease ended (``producer/gateway/stream_leases.py``), so a killed gateway's are too."""
    return f"{PREFIX}:streamleases"


# ---- per-tenant limits (producer.protocol.tenant_limits: the open work a tenant's limits count) ----
# one hash tag per tenant: the admission script reads and writes all of them at once
def tenant_open_jobs(tenant: str) -> str:
    """Sorted set of a tenant's admitted jobs not yet seen final, scored by admission time (ms)."""
    return f"{PREFIX}:limits:{{t:{tenant}}}:jobs"


def tenant_job_tokens(tenant: str) -> str:
    """Hash: each open job of a tenant -> the tokens it counts (prompt + max_tokens x n); field ``total``: their sum."""
    return f"{PREFIX}:limits:{{t:{tenant}}}:tokens"


def tenant_open_streams(tenant: str) -> str:
    """Sorted set of a tenant's open SSE streams (one token each), scored by lease expiry (ms): a gateway renews
    its streams' leases, so a killed gateway's streams stop counting when their leases run out."""
    return f"{PREFIX}:limits:{{t:{tenant}}}:streams"


def tenant_open_bulks(tenant: str) -> str:
    """Sorted set of a tenant's batches created through the gateway and not yet seen final, by admission time (ms)."""
    return f"{PREFIX}:limits:{{t:{tenant}}}:bulks"
