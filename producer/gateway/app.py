"""``pagestream gateway``: an OpenAI-compatible HTTP server that is a producer like any other.

Laid out as vLLM's entry points are: one router and one serving class per endpoint family
(``completions/``, ``chat/``, ``models/``, ``batches/`` for files and batches, ``health/``),
request and response models in ``protocol.py``, API-key auth as one dependency on every ``/v1``
router (``auth.py``), domain errors mapped to HTTP in one place (``errors.py``).

Each request is checked (JSON, schema, ranges, model served, context length, queue depth, API
key) and becomes one job on the model's lanes; a bad request gets OpenAI's error shape and never
reaches a worker. Streaming responses are server-sent events built from ``AsyncProducer.follow``,
every open stream read through one shared XREAD (``producer.client.mux``); a client that goes away
has its job cancelled (the worker aborts it within one step, freeing its KV blocks).
"""
from __future__ import annotations

from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import Depends, FastAPI

from pagestream.producer.client import AsyncProducer
from pagestream.producer.gateway import errors
from pagestream.producer.gateway.asgi import Accounting
from pagestream.producer.gateway.auth import require_api_key
from pagestream.producer.gateway.batches.api_router import router as batches_router
from pagestream.producer.gateway.batches.serving import OpenAIServingBatches
from pagestream.producer.gateway.chat.api_router import router as chat_router
from pagestream.producer.gateway.chat.serving import OpenAIServingChat
from pagestream.producer.gateway.completions.api_router import router as completions_router
from pagestream.producer.gateway.completions.serving import OpenAIServingCompletion
from pagestream.producer.gateway.health.api_router import router as health_router
from pagestream.producer.gateway.models.api_router import router as models_router
from pagestream.producer.gateway.models.serving import OpenAIServingModels
from pagestream.producer.gateway.settings import GatewaySettings
from pagestream.producer.gateway.state import GatewayState
from pagestream.producer.protocol.redis_conn import connect_async, url_is_cluster

#: the routers behind the API key, in the order their routes are matched
API_ROUTERS = (models_router, completions_router, chat_router, batches_router)


def _client(settings: GatewaySettings):
    if url_is_cluster(settings.redis_url):
        # Redis Cluster: one pool per node, each at most redis_max_connections
        return connect_async(settings.redis_url, max_connections=settings.redis_max_connections)
    pool = aioredis.BlockingConnectionPool.from_url(settings.redis_url, max_connections=settings.redis_max_connections,
                                                    timeout=30)
    return aioredis.Redis(connection_pool=pool)


def create_app(settings: GatewaySettings | None = None, producer: AsyncProducer | None = None) -> FastAPI:
    """The FastAPI app (``uvicorn`` serves it in ``pagestream gateway``)."""
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # one shared XREAD for every open stream and waiting request (client/mux), not one connection each
        state = GatewayState(settings, producer or AsyncProducer(_client(settings), multiplex_reads=True))
        state.models = OpenAIServingModels(state)
        state.completions = OpenAIServingCompletion(state)
        state.chat = OpenAIServingChat(state)
        state.batches = OpenAIServingBatches(state)
        app.state.gateway = state
        try:
            yield
        finally:
            await state.aclose()

    app = FastAPI(title="pagestream gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    errors.install(app)
    app.add_middleware(Accounting)
    app.include_router(health_router)
    for router in API_ROUTERS:
        app.include_router(router, dependencies=[Depends(require_api_key)])
    return app


def run(settings: GatewaySettings) -> None:
    """Serve until interrupted (uvicorn's own signal handling)."""
    import uvicorn

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
