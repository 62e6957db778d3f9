"""``/v1/responses``: create, retrieve, delete, cancel; every read scoped to the key's tenant."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagestream.producer.gateway.auth import require_api_key
from pagestream.producer.gateway.body import openai_request_object
from pagestream.producer.protocol.tenants import Tenant

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request, body: Annotated[dict[str, Any], Depends(openai_request_object)]) -> Response:
    return await request.app.state.gateway.responses.create(request, body)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str,
                            tenant: Annotated[Tenant, Depends(require_api_key)]) -> dict[str, Any]:
    return await request.app.state.gateway.responses.retrieve(response_id, tenant)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str,
                          tenant: Annotated[Tenant, Depends(require_api_key)]) -> dict[str, Any]:
    return await request.app.state.gateway.responses.delete(response_id, tenant)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str,
                          tenant: Annotated[Tenant, Depends(require_api_key)]) -> dict[str, Any]:
    return await request.app.state.gateway.responses.cancel(response_id, tenant)
