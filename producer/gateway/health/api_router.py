from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    try:
        await request.app.state.gateway.producer.redis.ping()
    except Exception as exc:  # any failure to reach Redis means not healthy
        return JSONResponse({"status": "unavailable", "error": type(exc).__name__}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)
