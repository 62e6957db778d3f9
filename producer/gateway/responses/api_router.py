"""``/v1/responses``: create, retrieve, delete, cancel; every read scoped to the key's tenant."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from pagestream.producer.gateway.auth import require_api_key
from pagestream.producer.gateway.body import openai_request_object
from pagestream.producer.protocol.tenants import Tenant

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request, body: Annotated[dict[str, Any], Depends(openai_request_object)]) -> Response:
    return await request.app.state.gateway.responses.create(request, body)


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve_response(request: Request, response_id: str, tenant: Annotated[Tenant, Depends(require_api_key)],
                            stream: bool = False, starting_after: Annotated[int | None, Query(ge=-1)] = None
                            ) -> dict[str, Any] | Response:
    """The stored response; ``stream=true``: a background response's events (after ``starting_after``)."""
    responses = request.app.state.gateway.responses
    if stream:
        return await responses.replay(request, response_id, tenant, starting_after)
    return await responses.retrieve(response_id, tenant)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str,
                          tenant: Annotated[Tenant, Depends(require_api_key)]) -> dict[str, Any]:
    return await request.app.state.gateway.responses.delete(response_id, tenant)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str,
                          tenant: Annotated[Tenant, Depends(require_api_key)]) -> dict[str, Any]:
    return await request.app.state.gateway.responses.cancel(response_id, tenant)
