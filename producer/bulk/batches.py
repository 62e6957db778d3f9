"""OpenAI's File and Batch objects over bulk jobs: what ``/v1/files`` and ``/v1/batches`` serve (no HTTP here:
errors are ``producer.protocol.errors``' ``NotFound`` and ``RequestError``, which the gateway maps).

- A file is a record in Redis (``keys.file_hash``) and its content in the files
  storage: a local directory by default, an S3 prefix when configured (the same
  ``producer.bulk.storage`` backends bulk input and output use). An upload is
  ``<file_id>.jsonl`` there.
- A batch is a bulk (``producer.bulk.api``) whose input is an uploaded file and
  whose output goes to ``batches/<batch_id>/`` of the same storage. Its output
  and error files are the bulk's shards, concatenated on download; their ids are
  fixed (``file-<batch_id>-output`` / ``-errors``) and registered once the bulk
  is final, so any gateway can serve them.
- ``batch_object`` is the OpenAI ``Batch`` of any bulk, also what
  ``pagestream bulk status --json`` prints.
- Every file and batch has an owner (``producer.protocol.tenants``): calls that take a ``Tenant``
  answer ``NotFound`` for another tenant's object, exactly as for one that does not exist, and list
  from the tenant's own index (``keys.tenant_files_index`` / ``tenant_bulks_index``), a page at a
  time, never a scan of everyone's. A batch's output and error files belong to the batch's tenant.
- A deleted batch output file leaves a tombstone, so the batch's manifest cannot register it again.

Calls here are blocking (redis-py, boto3); the gateway runs them in a thread.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.bulk import BulkField
from pagestream.producer.bulk.api import (
    BulkSpec,
    BulkStatus,
    cancel_bulk,
    create_bulk,
    enqueue_run,
    get_bulk,
    load_spec,
)
from pagestream.producer.bulk.finalize import MANIFEST
from pagestream.producer.bulk.io import CHAT_URL, SUPPORTED_URLS
from pagestream.producer.bulk.rq_queue import BULK_QUEUE
from pagestream.producer.bulk.storage import StorageSettings
from pagestream.producer.bulk.stores import Storage, open_storage
from pagestream.producer.protocol.errors import NotFound, RequestError
from pagestream.producer.protocol.tenants import ANONYMOUS, OPEN, TENANT_FIELD, Tenant
from pagestream.producer.protocol.wire import as_str

FILE_PURPOSES = ("batch",)
#: OpenAI offers one completion window; a batch not done by then ends ``expired`` with what is done
COMPLETION_WINDOWS = {"24h": 24 * 3600}
_OUTPUT_FILE = re.compile(r"^file-(batch_[A-Za-z0-9]+)-(output|errors)$")
_DOWNLOAD_CHUNK_BYTES = 1024 * 1024
#: ids read from an index per round trip while a page is filled
_INDEX_CHUNK = 256


def _storage_settings(spec: BulkSpec | None = None, settings: StorageSettings | None = None) -> StorageSettings:
    settings = settings or StorageSettings()
    if spec is not None and spec.s3_endpoint_url:
        settings = settings.model_copy(update={"s3_endpoint_url": spec.s3_endpoint_url})
    return settings


def public_file(record: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI ``FileObject`` of a record."""
    return {k: record.get(k) for k in ("id", "object", "bytes", "created_at", "filename", "purpose", "status")} | {
        "expires_at": None, "status_details": None}


class FileStore:
    """Uploaded files and batch output files: records in Redis, content in a bulk storage."""

    def __init__(self, conn: redis.Redis, root_uri: str, settings: StorageSettings | None = None) -> None:
        self.conn = conn
        self.root_uri = root_uri
        self.settings = _storage_settings(None, settings)
        self.storage: Storage = open_storage(root_uri, self.settings)

    def create(self, src_path: str, filename: str, purpose: str, tenant: str = ANONYMOUS) -> dict[str, Any]:
        """Store an upload (a local temp file) owned by ``tenant`` and return its ``FileObject``."""
        if purpose not in FILE_PURPOSES:
            raise RequestError(f"purpose must be one of {list(FILE_PURPOSES)}, got {purpose!r}", param="purpose")
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        name = f"{file_id}.jsonl"
        info = self.storage.put_file_once(name, src_path)
        record = {"id": file_id, "object": "file", "bytes": info.size_bytes, "created_at": int(time.time()),
                  "filename": filename, "purpose": purpose, "status": "processed", "uri": self.root_uri, "names": [name],
                  TENANT_FIELD: tenant}
        self._save(record)
        return public_file(record)

    def _save(self, record: dict[str, Any], only_new: bool = False) -> None:
        key = keys.file_hash(record["id"])
        if only_new and not self.conn.hsetnx(key, "record", json.dumps(record)):
            return
        pipe = self.conn.pipeline()
        if not only_new:
            pipe.hset(key, "record", json.dumps(record))
        score = {record["id"]: time.time()}  # finer than created_at (seconds): lists keep the order of creation
        pipe.zadd(keys.files_index(), score)
        pipe.zadd(keys.tenant_files_index(record.get(TENANT_FIELD) or ANONYMOUS), score)
        pipe.execute()

    def record(self, file_id: str, tenant: Tenant = OPEN) -> dict[str, Any]:
        """The record of a file ``tenant`` may see; ``NotFound`` otherwise (missing, deleted or another's)."""
        raw = self.conn.hget(keys.file_hash(file_id), "record")
        if raw is None:
            m = _OUTPUT_FILE.match(file_id)
            if m and register_outputs(self, m.group(1)):  # a final batch this gateway has not shown yet
                raw = self.conn.hget(keys.file_hash(file_id), "record")
        if raw is None:
            raise NotFound("file", file_id, "file_id")
        rec = json.loads(as_str(raw))
        if not tenant.owns(rec.get(TENANT_FIELD)):
            raise NotFound("file", file_id, "file_id")
        return rec

    def get(self, file_id: str, tenant: Tenant = OPEN) -> dict[str, Any]:
        return public_file(self.record(file_id, tenant))

    def list(self, purpose: str | None = None, limit: int = 10_000, after: str | None = None,
             tenant: Tenant = OPEN) -> dict[str, Any]:
        """One page of ``tenant``'s files, newest first (an admin: everyone's), from its index."""
        index = keys.files_index() if tenant.admin else keys.tenant_files_index(tenant.name)

        def load(file_id: str) -> dict[str, Any] | None:
            raw = self.conn.hget(keys.file_hash(file_id), "record")
            if raw is None:
                return None  # deleted meanwhile
            rec = json.loads(as_str(raw))
            return public_file(rec) if purpose is None or rec["purpose"] == purpose else None

        return _index_page(self.conn, index, after, limit, load)

    def content(self, file_id: str, tenant: Tenant = OPEN) -> Iterator[bytes]:
        """The file's bytes in chunks (a batch output: its shards one after another)."""
        rec = self.record(file_id, tenant)
        storage = self._storage_of(rec)
        buf = bytearray()
        for name in rec["names"]:
            for line, _ in storage.open_lines(name):
                buf += line + b"\n"
                if len(buf) >= _DOWNLOAD_CHUNK_BYTES:
                    yield bytes(buf)
                    buf.clear()
        if buf:
            yield bytes(buf)

    def delete(self, file_id: str, tenant: Tenant = OPEN) -> dict[str, Any]:
        rec = self.record(file_id, tenant)
        if _OUTPUT_FILE.match(file_id):  # its batch's manifest would register it again
            self.conn.set(keys.file_tombstone(file_id), "1")
        self._storage_of(rec).delete_many(rec["names"])
        pipe = self.conn.pipeline()
        pipe.delete(keys.file_hash(file_id))
        pipe.zrem(keys.files_index(), file_id)
        pipe.zrem(keys.tenant_files_index(rec.get(TENANT_FIELD) or ANONYMOUS), file_id)
        pipe.execute()
        return {"id": file_id, "object": "file", "deleted": True}

    def _storage_of(self, rec: dict[str, Any]) -> Storage:
        if rec["uri"] == self.root_uri:
            return self.storage
        return open_storage(rec["uri"], _storage_settings(None, self.settings))

    def input_uri(self, file_id: str, tenant: Tenant = OPEN) -> str:
        rec = self.record(file_id, tenant)
        if rec["purpose"] != "batch":
            raise RequestError(f"file {file_id} has purpose {rec['purpose']!r}; a batch needs purpose 'batch'",
                               param="input_file_id")
        return self._storage_of(rec).describe(rec["names"][0])


def _index_page(conn: redis.Redis, index: str, after: str | None, limit: int,
                load: Callable[[str], dict[str, Any] | None]) -> dict[str, Any]:
    """OpenAI's list page from a sorted-set index, newest first: the ``limit`` objects after ``after``
    (an id not in this index: an empty page) that ``load`` returns (``None``: skip), read a chunk at a time."""
    start = 0
    if after is not None:
        rank = conn.zrevrank(index, after)
        if rank is None:
            return _page([], limit)
        start = int(rank) + 1
    data: list[dict[str, Any]] = []
    while len(data) <= limit:
        ids = conn.zrevrange(index, start, start + _INDEX_CHUNK - 1)
        if not ids:
            break
        start += len(ids)
        for obj_id in ids:
            obj = load(as_str(obj_id))
            if obj is not None:
                data.append(obj)
                if len(data) > limit:
                    break
    return _page(data, limit)


def _page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}


def _manifest(spec: BulkSpec) -> dict[str, Any] | None:
    raw = open_storage(spec.output, _storage_settings(spec)).read_bytes(MANIFEST)
    return json.loads(raw) if raw is not None else None


def output_file_ids(bulk_id: str, manifest: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """(output_file_id, error_file_id) of a finalized bulk; an error file only when some line failed."""
    if manifest is None:
        return None, None
    return f"file-{bulk_id}-output", (f"file-{bulk_id}-errors" if manifest.get("error_shards") else None)


def register_outputs(files: FileStore, bulk_id: str, manifest: dict[str, Any] | None = None) -> bool:
    """Record a final bulk's output and error files (once); False if it has none yet."""
    try:
        spec = load_spec(files.conn, bulk_id)
    except KeyError:
        return False
    manifest = manifest if manifest is not None else _manifest(spec)
    if manifest is None:
        return False
    out_id, err_id = output_file_ids(bulk_id, manifest)
    owner = batch_owner(files.conn, bulk_id)
    for file_id, shards, suffix in ((out_id, manifest["output_shards"], "output"),
                                    (err_id, manifest.get("error_shards") or [], "errors")):
        if file_id is None or files.conn.exists(keys.file_tombstone(file_id)):
            continue
        files._save({"id": file_id, "object": "file", "bytes": sum(s["bytes"] for s in shards),
                     "created_at": int(time.time()), "filename": f"{bulk_id}_{suffix}.jsonl",
                     "purpose": "batch_output", "status": "processed", "uri": spec.output,
                     "names": [s["name"] for s in shards], TENANT_FIELD: owner}, only_new=True)
    return True


def _window(seconds: float | None) -> str:
    for name, s in COMPLETION_WINDOWS.items():
        if seconds == s:
            return name
    return "none" if seconds is None else f"{seconds / 3600:g}h"


def batch_object(conn: redis.Redis, bulk_id: str, files: FileStore | None = None, *,
                 internal: bool = False) -> dict[str, Any]:
    """The OpenAI ``Batch`` of a bulk (``openai.types.Batch`` validates it): OpenAI's fields only, as the
    API answers it (no server paths or internal fields). ``internal`` adds pagestream's own fields for an
    operator (input/output URIs, lines read, RQ job, manifest), as ``pagestream bulk status --json`` prints.
    Raises ``KeyError`` for an unknown bulk."""
    st = get_bulk(conn, bulk_id)
    spec = load_spec(conn, bulk_id)
    cancel_at, seen_endpoint = (as_str(v) for v in conn.hmget(keys.bulk_hash(bulk_id), BulkField.CANCEL_REQUESTED, BulkField.ENDPOINT))
    status = BulkStatus(st[BulkField.STATUS])
    finished = int(st[BulkField.FINISHED_AT]) if st.get(BulkField.FINISHED_AT) else None
    manifest = _manifest(spec) if status.is_final and st.get(BulkField.MANIFEST) else None
    out_id, err_id = output_file_ids(bulk_id, manifest)
    if files is not None and manifest is not None:
        register_outputs(files, bulk_id, manifest)
    window = spec.completion_window_s
    errors = None
    if st.get(BulkField.ERROR):
        errors = {"object": "list", "data": [{"code": "batch_failed", "message": st[BulkField.ERROR], "line": None, "param": None}]}

    def at(s: BulkStatus) -> int | None:
        return finished if status == s else None

    batch = {
        "id": bulk_id,
        "object": "batch",
        "endpoint": spec.endpoint or seen_endpoint or CHAT_URL,
        "errors": errors,
        "input_file_id": spec.input_file_id or spec.input,
        "completion_window": _window(window),
        "status": status.value,
        "output_file_id": out_id,
        "error_file_id": err_id,
        "created_at": int(spec.created_at),
        "in_progress_at": None,
        "expires_at": int(spec.created_at + window) if window else None,
        "finalizing_at": None,
        "completed_at": at(BulkStatus.COMPLETED),
        "failed_at": at(BulkStatus.FAILED),
        "expired_at": at(BulkStatus.EXPIRED),
        "cancelling_at": int(float(cancel_at)) if cancel_at else None,
        "cancelled_at": at(BulkStatus.CANCELLED),
        "request_counts": st["request_counts"],
        "metadata": spec.metadata,
        "model": spec.model,
    }
    return {**st, **batch} if internal else batch


def batch_owner(conn: redis.Redis, bulk_id: str) -> str | None:
    """The tenant that created a batch (``None``: a bulk made outside the gateway, or before tenants)."""
    return as_str(conn.hget(keys.bulk_hash(bulk_id), BulkField.TENANT))


def _check_owner(conn: redis.Redis, batch_id: str, tenant: Tenant) -> None:
    if not tenant.owns(batch_owner(conn, batch_id)):
        raise NotFound("batch", batch_id, "batch_id")


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def create_batch(
    conn: redis.Redis,
    files: FileStore,
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None = None,
    queue_name: str = BULK_QUEUE,
    tenant: Tenant = OPEN,
    bulk_id: str | None = None,
    tool_call_parser: str | None = None,
) -> dict[str, Any]:
    """Start a bulk over an uploaded file of ``tenant``'s (``POST /v1/batches``), owned by it; returns its ``Batch``.
    ``bulk_id``: one made by ``new_batch_id`` beforehand (the gateway counts it against the tenant's limits first);
    ``tool_call_parser``: the gateway's own (its chat completions' ``auto`` answers, so its batch lines' too)."""
    if endpoint not in SUPPORTED_URLS:
        raise RequestError(f"endpoint must be one of {list(SUPPORTED_URLS)}, got {endpoint!r}", param="endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise RequestError(f"completion_window must be one of {list(COMPLETION_WINDOWS)}, got {completion_window!r}",
                           param="completion_window")
    input_uri = files.input_uri(input_file_id, tenant)
    bulk_id = bulk_id or new_batch_id()
    create_bulk(input_uri, files.storage.describe(f"batches/{bulk_id}"), connection=conn, bulk_id=bulk_id,
                completion_window_s=COMPLETION_WINDOWS[completion_window], s3_endpoint_url=files.settings.s3_endpoint_url,
                endpoint=endpoint, input_file_id=input_file_id, metadata=metadata,
                served_models_only=True, tool_call_parser=tool_call_parser)
    pipe = conn.pipeline()
    pipe.hset(keys.bulk_hash(bulk_id), BulkField.TENANT, tenant.name)
    pipe.zadd(keys.tenant_bulks_index(tenant.name), {bulk_id: time.time()})
    pipe.execute()
    enqueue_run(conn, bulk_id, queue_name=queue_name)
    return batch_object(conn, bulk_id, files)


def get_batch(conn: redis.Redis, files: FileStore | None, batch_id: str, tenant: Tenant = OPEN) -> dict[str, Any]:
    _check_owner(conn, batch_id, tenant)
    try:
        return batch_object(conn, batch_id, files)
    except KeyError:
        raise NotFound("batch", batch_id, "batch_id") from None


def cancel_batch(conn: redis.Redis, files: FileStore | None, batch_id: str, tenant: Tenant = OPEN) -> dict[str, Any]:
    _check_owner(conn, batch_id, tenant)  # before anything is written
    try:
        cancel_bulk(conn, batch_id)
    except KeyError:
        raise NotFound("batch", batch_id, "batch_id") from None
    return batch_object(conn, batch_id, files)


def list_batches(conn: redis.Redis, files: FileStore | None, limit: int = 20, after: str | None = None,
                 tenant: Tenant = OPEN) -> dict[str, Any]:
    """One page of ``tenant``'s batches, newest first, from its index (an admin: every bulk's index)."""
    index = keys.bulk_index() if tenant.admin else keys.tenant_bulks_index(tenant.name)

    def load(bulk_id: str) -> dict[str, Any] | None:
        try:
            return batch_object(conn, bulk_id, files)
        except KeyError:
            return None  # its status hash expired

    return _index_page(conn, index, after, limit, load)
