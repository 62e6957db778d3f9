from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(await request.app.state.gateway.models.list())


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> JSONResponse:
    return JSONResponse(await request.app.state.gateway.models.retrieve(model))
