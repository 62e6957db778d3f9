"""The gateway's ``/v1/files`` and ``/v1/batches``: OpenAI's Batch API mapped onto bulk jobs.

The objects and their storage are ``producer.bulk.batches``; this file is the HTTP
side only. Those calls block (redis-py, boto3), so each runs in a worker thread;
a download streams the output shards as they are read.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import UploadFile

from pagestream.producer.bulk.batches import FileStore, cancel_batch, create_batch, get_batch, list_batches
from pagestream.producer.gateway.protocol import GatewayError
from pagestream.producer.protocol.redis_conn import connect
from pagestream.producer.protocol.schema import format_validation_error

if TYPE_CHECKING:
    from pagestream.producer.gateway.app import Gateway

MAX_LIST_LIMIT = 10_000


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


class BatchRoutes:
    """Files and batches for one gateway: a blocking Redis client and the file store, made on first use."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._conn: redis.Redis | None = None
        self._files: FileStore | None = None

    @property
    def conn(self) -> redis.Redis:
        if self._conn is None:
            self._conn = connect(self.gw.settings.redis_url)
        return self._conn

    @property
    def files(self) -> FileStore:
        if self._files is None:
            self._files = FileStore(self.conn, self.gw.settings.files_uri)
        return self._files

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    async def upload(self, request: Request) -> dict[str, Any]:
        limit = self.gw.settings.max_file_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit + 64 * 1024:  # room for the form around the file
            raise GatewayError(413, f"file is larger than {limit} bytes", code="file_too_large")
        try:
            form = await request.form(max_files=1, max_fields=8)
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
            return await asyncio.to_thread(self._store, upload, purpose)
        finally:
            await form.close()

    def _store(self, upload: UploadFile, purpose: str) -> dict[str, Any]:
        fd, path = tempfile.mkstemp(prefix="pagestream-upload-")
        try:
            with os.fdopen(fd, "wb") as out:
                upload.file.seek(0)
                shutil.copyfileobj(upload.file, out)
            return self.files.create(path, upload.filename or "upload.jsonl", purpose)
        finally:
            os.unlink(path)


def _limit(request: Request, default: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise GatewayError(400, f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", param="limit")
    return int(raw)


def add_batch_routes(app: FastAPI) -> None:
    """``/v1/files`` and ``/v1/batches`` on the gateway app (its state holds the ``Gateway``)."""

    def routes(request: Request) -> BatchRoutes:
        gw = request.app.state.gateway
        gw.check_key(request)
        if gw.batches is None:
            gw.batches = BatchRoutes(gw)
        return gw.batches

    @app.post("/v1/files")
    async def upload_file(request: Request) -> JSONResponse:
        return JSONResponse(await routes(request).upload(request))

    @app.get("/v1/files")
    async def list_files(request: Request) -> JSONResponse:
        r = routes(request)
        q = request.query_params
        return JSONResponse(await asyncio.to_thread(r.files.list, q.get("purpose"), _limit(request, MAX_LIST_LIMIT), q.get("after")))

    @app.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str) -> JSONResponse:
        r = routes(request)
        return JSONResponse(await asyncio.to_thread(r.files.get, file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> StreamingResponse:
        r = routes(request)
        await asyncio.to_thread(r.files.record, file_id)  # a missing file is a 404 before the body starts
        return StreamingResponse(r.files.content(file_id), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> JSONResponse:
        r = routes(request)
        return JSONResponse(await asyncio.to_thread(r.files.delete, file_id))

    @app.post("/v1/batches")
    async def create(request: Request) -> JSONResponse:
        r = routes(request)
        data = await r.gw.read_json(request)
        if not isinstance(data, dict):
            raise GatewayError(400, "request body must be a JSON object")
        try:
            body = BatchCreate.model_validate(data)
        except ValidationError as exc:
            errs = exc.errors()
            param = ".".join(str(x) for x in errs[0]["loc"]) if errs and errs[0].get("loc") else None
            raise GatewayError(422, format_validation_error(exc), param=param) from None
        return JSONResponse(await asyncio.to_thread(
            create_batch, r.conn, r.files, input_file_id=body.input_file_id, endpoint=body.endpoint,
            completion_window=body.completion_window, metadata=body.metadata, queue_name=r.gw.settings.bulk_queue))

    @app.get("/v1/batches")
    async def list_(request: Request) -> JSONResponse:
        r = routes(request)
        return JSONResponse(await asyncio.to_thread(list_batches, r.conn, r.files, _limit(request, 20), request.query_params.get("after")))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve(request: Request, batch_id: str) -> JSONResponse:
        r = routes(request)
        return JSONResponse(await asyncio.to_thread(get_batch, r.conn, r.files, batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(request: Request, batch_id: str) -> JSONResponse:
        r = routes(request)
        return JSONResponse(await asyncio.to_thread(cancel_batch, r.conn, r.files, batch_id))
