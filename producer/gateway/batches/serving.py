"""``/v1/files`` and ``/v1/batches``: the HTTP side of OpenAI's Batch API over bulk jobs.

The objects and their storage are ``producer.bulk.batches``; those calls block (redis-py,
boto3), so each runs in a worker thread; a download streams the output shards as they are read.
"""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Annotated, Any

import redis
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from starlette.datastructures import UploadFile

from pagestream.producer.bulk.batches import FileStore, cancel_batch, create_batch, get_batch, list_batches, new_batch_id
from pagestream.producer.gateway.chat.tools import auto_tool_parser
from pagestream.producer.gateway.errors import GatewayError
from pagestream.producer.gateway.protocol import MAX_LISTED_ERRORS, first_error_loc
from pagestream.producer.gateway.state import GatewayState
from pagestream.producer.protocol.redis_conn import connect
from pagestream.producer.protocol.schema import format_validation_error
from pagestream.producer.protocol.tenants import Tenant

MAX_LIST_LIMIT = 10_000
_LIMIT = re.compile(r"[0-9]{1,9}")  # ASCII digits only: str.isdigit also accepts '²', which int() refuses


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str
    # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
    metadata: dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]] | None = (
        Field(None, max_length=16))


_FORM_SLACK_BYTES = 64 * 1024  # room for the form around the file


def _capped(receive, max_bytes: int, file_limit: int):
    """``receive`` that raises a 413 as soon as the body has passed ``max_bytes``."""
    seen = 0

    async def receive_capped() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                raise GatewayError(413, f"file is larger than {file_limit} bytes", code="file_too_large")
        return message

    return receive_capped


def list_limit(request: Request, default: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not _LIMIT.fullmatch(raw) or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise GatewayError(400, f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", param="limit")
    return int(raw)


class OpenAIServingBatches:
    """Files and batches for one gateway: a blocking Redis client and the file store, made on first use."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.settings = state.settings
        self._conn: redis.Redis | None = None
        self._files: FileStore | None = None

    @property
    def conn(self) -> redis.Redis:
        if self._conn is None:
            self._conn = connect(self.settings.redis_url)
        return self._conn

    @property
    def files(self) -> FileStore:
        if self._files is None:
            self._files = FileStore(self.conn, self.settings.files_uri)
        return self._files

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    # -- files ------------------------------------------------------------------------------

    async def upload(self, request: Request, tenant: Tenant) -> dict[str, Any]:
        limit = self.settings.max_file_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit + _FORM_SLACK_BYTES:
            raise GatewayError(413, f"file is larger than {limit} bytes", code="file_too_large")
        # counted as it arrives: a chunked body (no content-length) is refused once it passes the limit,
        # not after it is spooled to disk whole
        request = Request(request.scope, _capped(request.receive, limit + _FORM_SLACK_BYTES, limit))
        try:
            form = await request.form(max_files=1, max_fields=8, max_part_size=64 * 1024)
        except GatewayError:
            raise
        except Exception as exc:  # starlette raises several kinds for a malformed body
            raise GatewayError(400, f"expected a multipart/form-data body with 'file' and 'purpose': {exc}") from None
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise GatewayError(422, "the form needs a 'file' part", param="file")
            if not isinstance(purpose, str):
                raise GatewayError(422, "the form needs a 'purpose' field", param="purpose")
            if upload.size is not None and upload.size > limit:
                raise GatewayError(413, f"file is larger than {limit} bytes", code="file_too_large")
            return await asyncio.to_thread(self._store, upload, purpose, tenant)
        finally:
            await form.close()

    def _store(self, upload: UploadFile, purpose: str, tenant: Tenant) -> dict[str, Any]:
        fd, path = tempfile.mkstemp(prefix="pagestream-upload-")
        try:
            with os.fdopen(fd, "wb") as out:
                upload.file.seek(0)
                shutil.copyfileobj(upload.file, out)
            return self.files.create(path, upload.filename or "upload.jsonl", purpose, tenant.name)
        finally:
            os.unlink(path)

    async def list_files(self, request: Request, tenant: Tenant) -> dict[str, Any]:
        q = request.query_params
        return await asyncio.to_thread(self.files.list, q.get("purpose"), list_limit(request, MAX_LIST_LIMIT), q.get("after"),
                                       tenant)

    async def get_file(self, file_id: str, tenant: Tenant) -> dict[str, Any]:
        return await asyncio.to_thread(self.files.get, file_id, tenant)

    async def file_content(self, file_id: str, tenant: Tenant) -> Iterator[bytes]:
        """The content's chunks, the first one read before the headers go out: a missing file, or data
        gone from the storage, is a 404, never a 200 and then nothing."""
        chunks = self.files.content(file_id, tenant)
        try:
            first = await asyncio.to_thread(next, chunks, b"")
        except FileNotFoundError:
            raise GatewayError(404, f"the content of file '{file_id}' is no longer stored", param="file_id",
                               code="not_found") from None

        def body() -> Iterator[bytes]:
            yield first
            yield from chunks

        return body()

    async def delete_file(self, file_id: str, tenant: Tenant) -> dict[str, Any]:
        return await asyncio.to_thread(self.files.delete, file_id, tenant)

    # -- batches ----------------------------------------------------------------------------

    async def create_batch(self, data: dict[str, Any], tenant: Tenant) -> dict[str, Any]:
        try:
            body = BatchCreate.model_validate(data)
        except ValidationError as exc:
            raise GatewayError(422, format_validation_error(exc, max_errors=MAX_LISTED_ERRORS), param=first_error_loc(exc)) from None
        bulk_id = new_batch_id()
        counted = await self.state.admission.admit_bulk(tenant.name, bulk_id)  # 429 past max_open_batches
        try:
            return await asyncio.to_thread(
                create_batch, self.conn, self.files, input_file_id=body.input_file_id, endpoint=body.endpoint,
                completion_window=body.completion_window, metadata=body.metadata, queue_name=self.settings.bulk_queue,
                tenant=tenant, bulk_id=bulk_id, tool_call_parser=auto_tool_parser(self.settings))
        except BaseException:
            if counted:
                await self.state.admission.release_bulk(tenant.name, bulk_id)
            raise

    async def list_batches(self, request: Request, tenant: Tenant) -> dict[str, Any]:
        return await asyncio.to_thread(list_batches, self.conn, self.files, list_limit(request, 20),
                                       request.query_params.get("after"), tenant)

    async def get_batch(self, batch_id: str, tenant: Tenant) -> dict[str, Any]:
        return await asyncio.to_thread(get_batch, self.conn, self.files, batch_id, tenant)

    async def cancel_batch(self, batch_id: str, tenant: Tenant) -> dict[str, Any]:
        return await asyncio.to_thread(cancel_batch, self.conn, self.files, batch_id, tenant)
