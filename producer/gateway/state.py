"""What every request of one gateway shares: settings, the one ``AsyncProducer``, metrics, background
tasks, and the serving object of each endpoint family (built once in ``app.py``'s lifespan)."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import Request
from prometheus_client import generate_latest

from pagestream.producer.client import AsyncProducer
from pagestream.producer.client.aio import cancel_until_done
from pagestream.producer.gateway.auth import KeyTable
from pagestream.producer.gateway.body import BodyChecks
from pagestream.producer.gateway.limits import TenantAdmission
from pagestream.producer.gateway.metrics import GatewayMetrics, append_exposition, fetch_exposition
from pagestream.producer.gateway.settings import GatewaySettings
from pagestream.producer.gateway.stream_leases import StreamLeases

if TYPE_CHECKING:
    from pagestream.producer.gateway.batches.serving import OpenAIServingBatches
    from pagestream.producer.gateway.chat.serving import OpenAIServingChat
    from pagestream.producer.gateway.completions.serving import OpenAIServingCompletion
    from pagestream.producer.gateway.models.serving import OpenAIServingModels
    from pagestream.producer.gateway.responses.serving import OpenAIServingResponses
    from pagestream.producer.gateway.tokenize.serving import OpenAIServingTokenization


class GatewayState:
    def __init__(self, settings: GatewaySettings, producer: AsyncProducer) -> None:
        self.settings = settings
        self.producer = producer
        self.keys = KeyTable(settings.key_specs())
        self.metrics = GatewayMetrics()
        self.admission = TenantAdmission(producer.redis, settings.limit_table())  # per-tenant limits
        self.body_checks = BodyChecks(settings.body_check_processes)  # large bodies judged off the GIL
        self._background: set[asyncio.Task] = set()
        self.leases = StreamLeases(self)  # streamed jobs whose client (or gateway) went away
        self._reaper: asyncio.Task | None = None
        # ``worker_metrics_url``: the worker whose series /metrics appends (``pagestream serve``)
        self._scrape = httpx.AsyncClient(trust_env=False) if settings.worker_metrics_url else None  # no proxy to loopback
        # set by app.py once the state exists (each takes the state)
        self.models: OpenAIServingModels
        self.completions: OpenAIServingCompletion
        self.chat: OpenAIServingChat
        self.responses: OpenAIServingResponses
        self.batches: OpenAIServingBatches
        self.tokenization: OpenAIServingTokenization

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` beside the requests (a cancel after a client left); awaited at shutdown."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def start(self) -> None:
        """Start what runs beside the requests for the gateway's life (the stream lease reaper)."""
        self._reaper = asyncio.get_running_loop().create_task(self.leases.reap())

    async def exposition(self) -> bytes:
        """What ``/metrics`` answers: the queue's gauges read now (bounded; left out when Redis does not answer),
        every series of this gateway, then those of ``worker_metrics_url``'s worker it does not have."""
        await self.metrics.queue.refresh(self.producer)
        own = generate_latest(self.metrics.registry)
        if self._scrape is None:
            return own
        other = await fetch_exposition(self._scrape, self.settings.worker_metrics_url, self.settings.worker_metrics_timeout_s)
        return append_exposition(own, other)

    async def aclose(self) -> None:
        if self._reaper is not None:
            await cancel_until_done(self._reaper)
        # background work (a batch's file written out, a cancelled job's cleanup) gets the shutdown bound
        # to finish; what is still running then is cancelled, so a stop is never held by a stuck call
        pending = [t for t in self._background if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.settings.shutdown_timeout_s)
            for task in pending:
                await cancel_until_done(task)
        self.batches.close()
        self.body_checks.close()
        if self._scrape is not None:
            await self._scrape.aclose()
        await self.producer.aclose()


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway
