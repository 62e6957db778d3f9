from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagestream.producer.gateway.body import openai_request_object

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: Request, body: Annotated[dict[str, Any], Depends(openai_request_object)]) -> Response:
    return await request.app.state.gateway.completions.create(request, body)
