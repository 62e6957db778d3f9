"""The open probes (no API key: load balancers, SageMaker, scrapers): ``/health``, ``/ping`` (GET and POST,
SageMaker's health check, the same answer as ``/health``), ``/version``, ``/load`` and ``/metrics``."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    try:
        await request.app.state.gateway.producer.redis.ping()
    except Exception as exc:  # any failure to reach Redis means not healthy
        return JSONResponse({"status": "unavailable", "error": type(exc).__name__}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ping", operation_id="ping_get")
@router.post("/ping", operation_id="ping_post")
async def ping(request: Request) -> JSONResponse:
    return await health(request)


@router.get("/version")
async def server_version() -> JSONResponse:
    try:
        found = version("pagestream")
    except PackageNotFoundError:  # run from a checkout that was never installed
        found = "unknown"
    return JSONResponse({"version": found})


@router.get("/load")
async def server_load(request: Request) -> JSONResponse:
    return JSONResponse({"server_load": request.app.state.server_load.in_flight})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    # the queue's gauges are read from Redis now, and pagestream serve's worker's series appended (GatewayState)
    return Response(await request.app.state.gateway.exposition(), media_type=CONTENT_TYPE_LATEST)
