"""``POST /invocations``, SageMaker's one inference route: a body with ``messages`` is a chat completion,
one with ``prompt`` a completion (vLLM routes by the body's shape the same way); anything else is a 400."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagestream.producer.gateway.body import openai_request_object
from pagestream.producer.gateway.errors import GatewayError

router = APIRouter()


@router.post("/invocations")
async def invocations(request: Request, body: Annotated[dict[str, Any], Depends(openai_request_object)]) -> Response:
    gateway = request.app.state.gateway
    if "messages" in body:
        return await gateway.chat.create(request, body)
    if "prompt" in body:
        return await gateway.completions.create(request, body)
    raise GatewayError(400, "Cannot find a suitable handler for the request: expected a chat completion body "
                            "(with 'messages') or a completion body (with 'prompt')")
