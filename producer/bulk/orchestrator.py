"""The bulk orchestrator: the RQ job that feeds a bulk's lines to the workers and finalizes it.

``run_bulk(bulk_id)`` is what RQ runs (JSON serializer, queue ``pagestream-bulk``).
It is safe to run again at any point (an RQ retry, a rescue after ``kill -9``):

- one orchestrator per bulk at a time: a lease in Redis (``SET NX PX``,
  refreshed by a heartbeat thread); every checkpoint commit is a MULTI/EXEC
  guarded by WATCH on the lease, so a stale orchestrator cannot commit;
- the input is read as a stream from the checkpointed byte offset; a chunk of
  lines becomes jobs and a checkpoint in one transaction, and job ids are
  derived from (bulk id, line) so a re-queued job is a no-op (the producer's
  submit is idempotent by job id);
- outstanding jobs (queued, not yet in a durable part) are bounded by
  ``max_outstanding``; completion counts come from the bulk sink, which counts
  each custom_id once (SADD) after its part is durable;
- finalize compacts the parts recorded in the status hash (``bulk_finalize``);
- a Redis outage is ridden out: every command retries with backoff
  (``producer.protocol.redis_conn``), a checkpoint commit whose reply was lost is not
  applied twice, and a lease that expired while Redis was away is taken back
  unless another orchestrator took it or the bulk ended meanwhile.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

import redis
from pydantic import ValidationError

from pagestream.producer.protocol import keys
from pagestream.producer.bulk.api import LEASE_S, load_spec, queue_finished_event, write_late_event
from pagestream.producer.bulk.finalize import PARTS_PREFIX, UNFINISHED_PART, compact, list_parts, manifest_header, remove_parts
from pagestream.producer.bulk.io import CHAT_URL, COMPLETIONS_URL, BadLine, BulkRequest, max_line_bytes, parse_line
from pagestream.producer.bulk.parts import TOOL_ANSWER, error_entry, request_id
from pagestream.producer.bulk.storage import StorageError, StorageSettings
from pagestream.producer.bulk.stores import open_input, open_storage, storage_settings_for
from pagestream.producer.client.producer import Producer
from pagestream.producer.protocol.errors import RequestError
from pagestream.producer.protocol.bulk import (COUNT_LUA, REFRESH_LEASE_LUA, BulkField, BulkSpec, BulkStatus, count_args,
                                              count_keys, progress_after_count, request_counts)
from pagestream.producer.protocol.bulk import decode as decode_bulk
from pagestream.producer.protocol.limits import job_limits
from pagestream.producer.protocol.events import events_maxlen
from pagestream.producer.protocol.redis_conn import is_cluster, outage_proof, outage_retry, same_server
from pagestream.producer.protocol.settings import redis_url as main_redis_url
from pagestream.producer.protocol.settings import rq_redis_url
from pagestream.producer.protocol.schema import JobRequest, OutputTarget, format_validation_error
from pagestream.producer.protocol.tools import no_tool_format
from pagestream.producer.protocol.wire import as_str

log = logging.getLogger(__name__)

#: input lines per checkpoint transaction, and the bytes a chunk may hold (long lines make short chunks)
CHUNK_LINES = 256
CHUNK_BYTES = 32 * 1024 * 1024
POLL_S = 0.2
META_EVERY_S = 1.0
#: how long a cancelled bulk waits for jobs already running before finalizing what is done (queued ones
#: are skipped by the workers at once); a line not done by then is a "cancelled" error line
CANCEL_GRACE_S = float(os.environ.get("PAGESTREAM_BULK_CANCEL_GRACE_S", "2"))
#: the error message of a line a cancelled / expired bulk never ran, by final status
UNFINISHED_REASONS = {
    BulkStatus.CANCELLED: "the batch was cancelled before this request completed",
    BulkStatus.EXPIRED: "this request could not be executed before the completion window expired",
}
#: keep the status hash this long after the bulk is final
STATUS_TTL_S = 30 * 24 * 3600

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class BulkFailed(RuntimeError):
    """The bulk ended as failed; the message is what ``bulk status`` shows."""


class LeaseLost(RuntimeError):
    """Another orchestrator took over this bulk; this one stops without writing."""


def run_bulk(bulk_id: str, redis_url: str | None = None) -> dict[str, Any]:
    """RQ entry point: run (or resume) bulk ``bulk_id`` to a final status; returns its status dict."""
    from rq import get_current_job

    job = get_current_job()
    if redis_url is None and rq_redis_url() is not None:
        # RQ runs on a Redis of its own (the bulk's Redis is a cluster): the bulk-worker names
        # the bulk's Redis in PAGESTREAM_REDIS_URL, never the job (its argument is the bulk id alone)
        redis_url = main_redis_url()
    if redis_url is not None:
        conn = outage_proof(redis_url, decode_responses=True)
    elif job is not None:
        conn = same_server(job.connection, decode_responses=True, retry=outage_retry())
    else:
        raise ValueError("run_bulk outside RQ needs redis_url")
    return Orchestrator(conn, bulk_id, rq_job=job).run()


def bulk_job(req: BulkRequest, spec: BulkSpec) -> dict[str, Any] | BadLine:
    """The job of one parsed input line as ``JobRequest`` keyword fields (validated, limits
    included), or the line's error when the job schema refuses it."""
    body = req.body
    if spec.endpoint is not None and req.url != spec.endpoint:
        return BadLine(req.line, f"url {req.url} differs from the batch's endpoint {spec.endpoint}", req.custom_id)
    # nested, so an unbounded max_tokens (None) is kept rather than read as "not given"
    sampling = {**body.sampling(), "max_tokens": req.max_tokens()}
    if req.logprobs is not None:
        sampling["logprobs"] = req.logprobs
    fields: dict[str, Any] = dict(
        job_id=request_id(spec.bulk_id, req.line),
        model=body.model or spec.model,
        lane=spec.lane,
        result_ttl_s=min(spec.job_result_ttl_s, job_limits().max_result_ttl_s),  # a lowered limit must not fail every line
        output=OutputTarget(kind="bulk", bulk_id=spec.bulk_id, custom_id=req.custom_id, uri=spec.output),
        metadata={"bulk_line": req.line},
        sampling=sampling,
    )
    if req.is_chat:
        fields["messages"] = req.messages()
        fields.update(body.template_options())  # the job schema checks the kwargs (bounds, reserved keys)
        try:  # tools as the gateway's chat request puts them on its job, and how the output line reads calls
            use = body.tool_use()
            answer = use.answering(spec.tool_call_parser)
            tool_fields = use.job_fields(body.response_format, body.structured_outputs)
        except RequestError as exc:
            return BadLine(req.line, exc.message, req.custom_id)
        if "tools" in tool_fields:
            fields["tools"] = tool_fields["tools"]
        if "structured_outputs" in tool_fields:
            sampling["structured_outputs"] = tool_fields["structured_outputs"]
        if answer is not None:
            fields["metadata"][TOOL_ANSWER] = answer.model_dump(exclude_none=True)
    else:
        fields["prompt"] = body.prompt
    try:
        JobRequest(**fields)
    except ValidationError as exc:
        return BadLine(req.line, format_validation_error(exc, max_errors=3), req.custom_id)
    return fields


class Orchestrator:
    def __init__(self, conn: redis.Redis, bulk_id: str, rq_job=None, storage_settings: StorageSettings | None = None):
        self.conn = conn
        self.bulk_id = bulk_id
        self.rq_job = rq_job
        self.key = keys.bulk_hash(bulk_id)
        self.lock_key = keys.bulk_lock(bulk_id)
        self.spec: BulkSpec = load_spec(conn, bulk_id)
        settings = storage_settings_for(self.spec, storage_settings)
        self.storage_settings = settings
        self.producer = Producer(conn)
        self.token = f"{time.time():.6f}-{id(self)}"
        self.lease_lost = threading.Event()
        self._stop = threading.Event()
        self._refresh = conn.register_script(REFRESH_LEASE_LUA)
        self._release = conn.register_script(_RELEASE_LUA)
        self._last_meta = 0.0

    # ---- state ------------------------------------------------------------------------------
    def state(self) -> dict[str, str]:
        return decode_bulk(self.conn.hgetall(self.key))

    def status(self) -> BulkStatus:
        return BulkStatus(as_str(self.conn.hget(self.key, BulkField.STATUS)))

    def summary(self) -> dict[str, Any]:
        st = self.state()
        return {"bulk_id": self.bulk_id, "status": st.get(BulkField.STATUS), "request_counts": request_counts(st),
                "manifest": st.get(BulkField.MANIFEST), "error": st.get(BulkField.ERROR)}

    def _set_status(self, status: BulkStatus, **fields: Any) -> None:
        self.conn.hset(self.key, mapping={BulkField.STATUS: status.value, **{k: str(v) for k, v in fields.items()}})
        self._save_meta(force=True)

    def _save_meta(self, force: bool = False) -> None:
        now = time.time()
        if self.rq_job is None or (not force and now - self._last_meta < META_EVERY_S):
            return
        self._last_meta = now
        st = self.state()
        counts = request_counts(st)
        self.rq_job.meta.update({
            "bulk_id": self.bulk_id,
            "status": st.get(BulkField.STATUS),
            "request_counts": counts,
            "progress": {"lines_read": int(st.get(BulkField.LINE, 0)), "input_done": st.get(BulkField.INPUT_DONE) == "1",
                         "done": counts["completed"] + counts["failed"]},
        })
        try:
            self.rq_job.save_meta()
        except redis.RedisError:
            log.warning("bulk %s: could not save RQ job meta", self.bulk_id, exc_info=True)

    # ---- lease ------------------------------------------------------------------------------
    def _acquire(self) -> bool:
        deadline = time.time() + 2 * LEASE_S
        while time.time() < deadline:
            if self.conn.set(self.lock_key, self.token, nx=True, px=int(LEASE_S * 1000)):
                self.conn.hset(self.key, BulkField.HEARTBEAT_AT, repr(time.time()))
                return True
            if self.status().is_final:
                return False
            time.sleep(0.5)
        return False

    def _heartbeat(self) -> None:
        while not self._stop.wait(LEASE_S / 3):
            try:
                if not self._refresh(keys=[self.lock_key, self.key], args=[self.token, int(LEASE_S * 1000)]):
                    self.lease_lost.set()
                    return
                self.conn.hset(self.key, BulkField.HEARTBEAT_AT, repr(time.time()))
            except redis.RedisError:
                log.warning("bulk %s: lease refresh failed", self.bulk_id, exc_info=True)

    def _check_lease(self) -> None:
        if self.lease_lost.is_set():
            raise LeaseLost(f"bulk {self.bulk_id}: lease lost to another orchestrator")

    # ---- run --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        status = self.status()
        if status == BulkStatus.FAILED:
            raise BulkFailed(self.state().get("error") or "bulk failed")
        if status.is_final:
            return self.summary()
        if not self._acquire():
            log.info("bulk %s is being run by another orchestrator", self.bulk_id)
            return self.summary()
        if self.status().is_final:  # finished by the previous lease holder meanwhile
            self._release(keys=[self.lock_key], args=[self.token])
            return self.summary()
        beat = threading.Thread(target=self._heartbeat, name=f"bulk-lease-{self.bulk_id}", daemon=True)
        beat.start()
        try:
            self._run_locked()
        except (BulkFailed, StorageError) as exc:
            if isinstance(exc, StorageError) and not exc.permanent:
                raise  # transient after all retries: let RQ retry the job, which resumes
            self._fail(str(exc))
            raise BulkFailed(str(exc)) from exc
        finally:
            self._stop.set()
            beat.join(timeout=5)
            self._release(keys=[self.lock_key], args=[self.token])
        return self.summary()

    def _fail(self, message: str) -> None:
        log.error("bulk %s failed: %s", self.bulk_id, message)
        now = time.time()
        pipe = self.conn.pipeline(transaction=True)  # the status and its bulk_finished event together
        pipe.hset(self.key, mapping={BulkField.STATUS: BulkStatus.FAILED.value, BulkField.ERROR: message,
                                     BulkField.FINISHED_AT: repr(now)})
        late = queue_finished_event(self.conn, pipe, self.bulk_id, BulkStatus.FAILED, request_counts(self.state()),
                                    self.spec.batch_id, message, now)
        pipe.expire(self.key, STATUS_TTL_S)
        pipe.execute()
        write_late_event(self.conn, late)
        self._save_meta(force=True)
        self.conn.delete(keys.bulk_seen_hash(self.bulk_id), keys.bulk_done_set(self.bulk_id),
                         keys.bulk_part_seq(self.bulk_id))

    def _run_locked(self) -> None:
        if self.status() == BulkStatus.VALIDATING:
            self._validate()
            self._set_status(BulkStatus.IN_PROGRESS)
        st = self.state()
        if st.get(BulkField.INPUT_DONE) != "1" and not self._should_stop_feeding(st):
            self._feed()
        self._drain()
        self._finalize()

    def _validate(self) -> None:
        """Fail fast, before a job is queued, on an unreadable input or an unwritable output.

        Only permanent errors fail the bulk; a transient one (after botocore's retries)
        propagates so RQ retries the job, which validates again."""
        try:
            storage, name = open_input(self.spec.input, self.storage_settings)
            storage.check_readable(name)
        except StorageError as exc:
            if not exc.permanent:
                raise
            raise BulkFailed(f"input {self.spec.input} is not readable: {exc}") from exc
        except ValueError as exc:
            raise BulkFailed(str(exc)) from exc
        try:
            open_storage(self.spec.output, self.storage_settings).check_writable()
        except StorageError as exc:
            if not exc.permanent:
                raise
            raise BulkFailed(f"output {self.spec.output} is not writable: {exc}") from exc
        except ValueError as exc:
            raise BulkFailed(str(exc)) from exc

    def _should_stop_feeding(self, st: dict[str, str]) -> bool:
        if st.get(BulkField.CANCEL_REQUESTED):
            return True
        window = self.spec.completion_window_s
        return window is not None and time.time() > self.spec.created_at + window

    def _check_sink(self, st: dict[str, str]) -> None:
        if st.get(BulkField.SINK_ERROR_PERMANENT) == "1":
            raise BulkFailed(f"workers cannot write parts to {self.spec.output}: {st.get('sink_error')}")

    # ---- feed -------------------------------------------------------------------------------
    def _feed(self) -> None:
        st = self.state()
        line = int(st.get(BulkField.LINE, 0))
        offset = int(st.get(BulkField.OFFSET, 0))
        storage, name = open_input(self.spec.input, self.storage_settings)
        out = open_storage(self.spec.output, self.storage_settings)
        chunk: list[tuple[int, bytes]] = []
        chunk_bytes = 0
        # An overlong line arrives cut short (memory stays bounded) and becomes an error line.
        for raw, end in storage.open_lines(name, offset, max_line_bytes=max_line_bytes()):
            line += 1
            chunk.append((line, raw))
            chunk_bytes += len(raw)
            if len(chunk) >= CHUNK_LINES or chunk_bytes >= CHUNK_BYTES:
                self._commit(chunk, end, out)
                chunk, chunk_bytes = [], 0
                if not self._throttle():
                    return
        self._commit(chunk, None, out, input_done=True)

    def _throttle(self) -> bool:
        """Wait while too many jobs are outstanding; False if feeding should stop (cancel/expiry)."""
        while True:
            self._check_lease()
            st = self.state()
            self._check_sink(st)
            self._save_meta()
            if self._should_stop_feeding(st):
                return False
            outstanding = int(st.get(BulkField.SUBMITTED, 0)) - int(st.get(BulkField.COMPLETED, 0)) - int(st.get(BulkField.FAILED, 0))
            if outstanding < self.spec.max_outstanding:
                return True
            time.sleep(POLL_S)

    def _jobs_for(self, chunk: list[tuple[int, bytes]]) -> tuple[list[dict[str, Any]], list[BadLine]]:
        """Valid lines as JobRequest keyword fields (already validated), and the bad lines."""
        parsed: list[BulkRequest] = []
        bad: list[BadLine] = []
        for line, raw in chunk:
            item = parse_line(raw, line)
            if item is None:
                continue
            (bad if isinstance(item, BadLine) else parsed).append(item)
        if parsed:
            # First line to use a custom_id owns it; HSETNX keeps that across a resume.
            seen_key = keys.bulk_seen_hash(self.bulk_id)
            pipe = self.conn.pipeline(transaction=False)
            for req in parsed:
                pipe.hsetnx(seen_key, req.custom_id, req.line)
            pipe.hmget(seen_key, [req.custom_id for req in parsed])
            owners = pipe.execute()[-1]
            unique = []
            for req, owner in zip(parsed, owners):
                if int(owner) != req.line:
                    bad.append(BadLine(req.line, f"duplicate custom_id (first used on line {owner})", req.custom_id))
                else:
                    unique.append(req)
            parsed = unique
        jobs = []
        for req in parsed:
            item = bulk_job(req, self.spec)
            (bad if isinstance(item, BadLine) else jobs).append(item)
        return jobs, sorted(bad, key=lambda b: b.line)

    def _unserved(self, jobs: list[dict[str, Any]], live: set[str]) -> tuple[list[dict[str, Any]], list[BadLine]]:
        """Split off the lines no live worker can answer: a Batch API bulk's (``spec.served_models_only``) lines
        whose model no live worker announces, as the gateway's chat endpoint answers 404 ``model_not_found`` from
        the same announcements; and any bulk's lines with tools for an announced model whose chat template has no
        tool format, as the gateway's 400 (never a line run with its tools dropped by the template)."""
        kept, bad = [], []
        no_tools = self._no_tool_format(jobs, live)
        for fields in jobs:
            model = fields["model"]
            if fields.get("tools") and model in no_tools:
                bad.append(BadLine(fields["metadata"]["bulk_line"], no_tool_format(model), fields["output"].custom_id))
            elif model in live or not self.spec.served_models_only:
                kept.append(fields)
            else:
                reason = ("the request has no model and the batch names none" if model is None else
                          f"The model '{model}' does not exist or no worker serves it (served: {sorted(live) or 'none'})")
                bad.append(BadLine(fields["metadata"]["bulk_line"], reason, fields["output"].custom_id,
                                   code="model_not_found"))
        return kept, bad

    def _no_tool_format(self, jobs: list[dict[str, Any]], live: set[str]) -> set[str]:
        """The announced models of lines with tools whose workers say their template never reads ``tools``."""
        names = sorted({fields["model"] for fields in jobs if fields.get("tools") and fields["model"] in live})
        if not names:
            return set()
        out = set()
        for name, raw in zip(names, self.conn.hmget(keys.model_info(), names)):
            try:
                info = json.loads(raw) if raw else {}
            except ValueError:
                info = {}
            if isinstance(info, dict) and info.get("chat_tools") is False:
                out.add(name)
        return out

    def _commit(self, chunk: list[tuple[int, bytes]], end_offset: int | None, out, input_done: bool = False) -> None:
        jobs, bad = self._jobs_for(chunk)
        live = set(self.producer.live_models()) if jobs else set()
        jobs, unserved = self._unserved(jobs, live)
        if unserved:
            bad = sorted(bad + unserved, key=lambda b: b.line)
        if bad:
            # Deterministic name: a resumed chunk rewrites the same bytes.
            data = b"".join(error_entry(self.bulk_id, b.line, b.reason, b.custom_id, b.code).dumps() for b in bad)
            out.put_bytes(f"{PARTS_PREFIX}_input-{bad[0].line:010d}.jsonl", data)
        last_line = chunk[-1][0] if chunk else None
        # Routing by model: a line whose model some worker announces goes to that model's lanes;
        # any other stays on the shared lanes, for workers that serve no named model (``bulk submit``).
        routed = [{**fields, "model": fields["model"] if fields["model"] in live else None} for fields in jobs]
        if routed and is_cluster(self.conn):
            # On a cluster the jobs cannot join the checkpoint's transaction (other slots): they
            # are submitted first, then the checkpoint commits. A crash between the two re-feeds
            # the chunk on resume, and its job ids (bulk id + line) make every submit a no-op.
            self._check_lease()
            self.producer.submit_many(routed, queue_unserved=True)
            routed_in_commit: list[dict[str, Any]] = []
        else:
            routed_in_commit = routed
        while True:
            self._check_lease()
            with self.conn.pipeline(transaction=True) as pipe:  # the lease and status hash share the bulk's slot
                try:
                    pipe.watch(self.lock_key)
                    if as_str(pipe.get(self.lock_key)) != self.token:
                        raise LeaseLost(f"bulk {self.bulk_id}: lease lost before commit")
                    if last_line is not None and int(pipe.hget(self.key, BulkField.LINE) or 0) >= last_line:
                        return  # this commit landed but its reply was lost (Redis went away): not twice
                    pipe.multi()
                    for fields in routed_in_commit:
                        self.producer.submit(pipeline=pipe, queue_unserved=True, **fields)
                    mapping: dict[str, Any] = {}
                    if last_line is not None:
                        mapping[BulkField.LINE] = last_line
                    if end_offset is not None:
                        mapping[BulkField.OFFSET] = end_offset
                    if input_done:
                        mapping[BulkField.INPUT_DONE] = "1"
                    if mapping:
                        pipe.hset(self.key, mapping=mapping)
                    if jobs:  # the Batch object's endpoint, for bulks not created with one (producer.bulk.batches)
                        pipe.hsetnx(self.key, BulkField.ENDPOINT, CHAT_URL if "messages" in jobs[0] else COMPLETIONS_URL)
                    cluster, now = is_cluster(self.conn), time.time()
                    if bad:  # their part is written: counted by the script that writes the bulk's progress event
                        ck = count_keys(self.bulk_id, cluster)
                        # (EVAL by hand: a cluster pipeline has no eval(); its keys route it to the bulk's slot)
                        pipe.execute_command("EVAL", COUNT_LUA, len(ck), *ck, *count_args(
                            now, events_maxlen(), self.bulk_id, self.spec.batch_id, submitted=len(jobs), invalid=len(bad)))
                    else:
                        pipe.hincrby(self.key, BulkField.SUBMITTED, len(jobs))
                    written = pipe.execute()
                    if bad:
                        progress_after_count(self.conn, cluster, written[-1], self.bulk_id, now, self.spec.batch_id)
                    return
                except redis.WatchError:
                    # the heartbeat's PEXPIRE touched the lease, or the connection dropped
                    # while watching: re-check and retry
                    continue

    # ---- drain + finalize ---------------------------------------------------------------------
    def _drain(self) -> None:
        cancel_deadline = None
        while True:
            self._check_lease()
            st = self.state()
            self._check_sink(st)
            self._save_meta()
            # "skipped": jobs a worker acked unrun because the bulk is cancelling (worker.bulk_gate)
            done = int(st.get(BulkField.COMPLETED, 0)) + int(st.get(BulkField.FAILED, 0)) + int(st.get(BulkField.SKIPPED, 0))
            if done >= int(st.get(BulkField.SUBMITTED, 0)) or st.get(BulkField.FINALIZE_PARTS):
                return
            if self._should_stop_feeding(st):
                if not st.get(BulkField.CANCEL_REQUESTED):
                    return  # expired: finalize what is done now, like OpenAI's expired batches
                if cancel_deadline is None:
                    cancel_deadline = time.time() + CANCEL_GRACE_S
                    if st.get(BulkField.STATUS) != BulkStatus.CANCELLING.value:
                        self._set_status(BulkStatus.CANCELLING)
                elif time.time() > cancel_deadline:
                    return
            time.sleep(POLL_S)

    def _final_status(self, st: dict[str, str]) -> BulkStatus:
        if st.get(BulkField.FINAL_STATUS):
            return BulkStatus(st[BulkField.FINAL_STATUS])
        if st.get(BulkField.CANCEL_REQUESTED):
            return BulkStatus.CANCELLED
        if st.get(BulkField.INPUT_DONE) != "1" or int(st.get(BulkField.COMPLETED, 0)) + int(st.get(BulkField.FAILED, 0)) < int(st.get(BulkField.SUBMITTED, 0)):
            return BulkStatus.EXPIRED
        return BulkStatus.COMPLETED

    def _write_unfinished(self, out, final: BulkStatus) -> None:
        """An error line (code "cancelled" / "expired") for every input line, as a fallback part:
        compaction keeps it only for a line no other part has, so every line is in the output or the errors."""
        storage, name = open_input(self.spec.input, self.storage_settings)
        reason, code = UNFINISHED_REASONS[final], final.value
        chunks: list[bytes] = []
        for line, (raw, _) in enumerate(storage.open_lines(name, 0, max_line_bytes=max_line_bytes()), start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "x"  # not blank: the feed made it an error line
            if not text.strip():
                continue  # blank lines are no requests
            try:
                custom_id = json.loads(text).get("custom_id")
            except (ValueError, AttributeError):
                custom_id = None
            chunks.append(error_entry(self.bulk_id, line, reason, custom_id if isinstance(custom_id, str) else None,
                                      code).dumps())
            if line % 4096 == 0:
                self._check_lease()
        out.put_bytes(UNFINISHED_PART, b"".join(chunks))

    def _finalize(self) -> None:
        st = self.state()
        final = self._final_status(st)
        out = open_storage(self.spec.output, self.storage_settings)
        if not st.get(BulkField.FINALIZE_PARTS):
            if final in UNFINISHED_REASONS:
                self._write_unfinished(out, final)
            # Freeze the part list: a late duplicate part must not change a re-run's bytes.
            self.conn.hset(self.key, mapping={BulkField.FINALIZE_PARTS: json.dumps(list_parts(out)), BulkField.FINAL_STATUS: final.value})
            st = self.state()
        parts = json.loads(st[BulkField.FINALIZE_PARTS])
        if final == BulkStatus.COMPLETED:
            self._set_status(BulkStatus.FINALIZING)
        manifest = compact(out, parts, bulk_id=self.bulk_id, shard_lines=self.spec.shard_lines,
                           header=manifest_header(self.spec, final.value), on_progress=self._check_lease)
        self._check_lease()
        counts = manifest["request_counts"]
        now = time.time()
        pipe = self.conn.pipeline(transaction=True)  # every key here carries the bulk's hash tag (the events stream: single node)
        pipe.hset(self.key, mapping={
            BulkField.STATUS: final.value, BulkField.FINISHED_AT: repr(now), BulkField.MANIFEST: out.describe("manifest.json"),
            BulkField.FINAL_COUNTS: json.dumps(counts)})
        late = queue_finished_event(self.conn, pipe, self.bulk_id, final, counts, self.spec.batch_id, ts=now)
        pipe.hdel(self.key, BulkField.FINALIZE_PARTS)
        pipe.delete(keys.bulk_seen_hash(self.bulk_id), keys.bulk_done_set(self.bulk_id),
                    keys.bulk_part_seq(self.bulk_id))
        pipe.expire(self.key, STATUS_TTL_S)
        pipe.execute()
        write_late_event(self.conn, late)
        self._save_meta(force=True)
        try:
            remove_parts(out)
        except StorageError:
            log.warning("bulk %s: could not remove part files (the manifest is written)", self.bulk_id, exc_info=True)
