from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagestream.producer.gateway.auth import require_api_key
from pagestream.producer.gateway.batches.serving import OpenAIServingBatches
from pagestream.producer.gateway.body import json_object
from pagestream.producer.protocol.tenants import Tenant

router = APIRouter()


async def serving(request: Request) -> OpenAIServingBatches:  # async: a plain def would run in the thread pool
    return request.app.state.gateway.batches


Batches = Annotated[OpenAIServingBatches, Depends(serving)]
#: who asks (the router's auth dependency, run once per request): every object below is scoped to it
Caller = Annotated[Tenant, Depends(require_api_key)]


@router.post("/v1/files")
async def upload_file(request: Request, s: Batches, tenant: Caller) -> JSONResponse:
    return JSONResponse(await s.upload(request, tenant))


@router.get("/v1/files")
async def list_files(request: Request, s: Batches, tenant: Caller) -> JSONResponse:
    return JSONResponse(await s.list_files(request, tenant))


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, s: Batches, tenant: Caller) -> JSONResponse:
    return JSONResponse(await s.get_file(file_id, tenant))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, s: Batches, tenant: Caller) -> StreamingResponse:
    return StreamingResponse(await s.file_content(file_id, tenant), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, s: Batches, tenant: Caller) -> JSONResponse:
    return JSONResponse(await s.delete_file(file_id, tenant))


@router.post("/v1/batches")
async def create_batch(s: Batches, tenant: Caller, body: Annotated[dict[str, Any], Depends(json_object)]) -> JSONResponse:
    return JSONResponse(await s.create_batch(body, tenant))


@router.get("/v1/batches")
async def list_batches(request: Request, s: Batches, tenant: Caller) -> JSONResponse:
    return JSONResponse(await s.list_batches(request, tenant))


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, s: Batches, tenant: Caller) -> JSONResponse:
    return JSONResponse(await s.get_batch(batch_id, tenant))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, s: Batches, tenant: Caller) -> JSONResponse:
    return JSONResponse(await s.cancel_batch(batch_id, tenant))
