from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagestream.producer.gateway.serving import resume

router = APIRouter()


@router.get("/v1/streams/{job_id}")
async def resume_stream(request: Request, job_id: str) -> Response:
    return await resume(request.app.state.gateway, request, job_id)
