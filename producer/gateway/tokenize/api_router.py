from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from pagestream.producer.gateway.body import json_object

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request, body: Annotated[dict[str, Any], Depends(json_object)]) -> JSONResponse:
    return JSONResponse(await request.app.state.gateway.tokenization.tokenize(body))


@router.post("/detokenize")
async def detokenize(request: Request, body: Annotated[dict[str, Any], Depends(json_object)]) -> JSONResponse:
    return JSONResponse(await request.app.state.gateway.tokenization.detokenize(body))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> JSONResponse:
    return JSONResponse(await request.app.state.gateway.tokenization.tokenizer_info(model))
