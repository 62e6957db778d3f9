"""What every request of one gateway shares: settings, the one ``AsyncProducer``, metrics, background
tasks, and the serving object of each endpoint family (built once in ``app.py``'s lifespan)."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from fastapi import Request

from pagestream.producer.client import AsyncProducer
from pagestream.producer.gateway.auth import KeyTable
from pagestream.producer.gateway.metrics import GatewayMetrics
from pagestream.producer.gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from pagestream.producer.gateway.batches.serving import OpenAIServingBatches
    from pagestream.producer.gateway.chat.serving import OpenAIServingChat
    from pagestream.producer.gateway.completions.serving import OpenAIServingCompletion
    from pagestream.producer.gateway.models.serving import OpenAIServingModels


class GatewayState:
    def __init__(self, settings: GatewaySettings, producer: AsyncProducer) -> None:
        self.settings = settings
        self.producer = producer
        self.keys = KeyTable(settings.key_specs())
        self.metrics = GatewayMetrics()
        self._background: set[asyncio.Task] = set()
        # set by app.py once the state exists (each takes the state)
        self.models: OpenAIServingModels
        self.completions: OpenAIServingCompletion
        self.chat: OpenAIServingChat
        self.batches: OpenAIServingBatches

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` beside the requests (a cancel after a client left); awaited at shutdown."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)
        self.batches.close()
        await self.producer.aclose()


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway
