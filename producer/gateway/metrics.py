"""The gateway's Prometheus metrics (served on its own ``/metrics``), their label sets bounded.

An endpoint label is the matched route's template (``/v1/files/{file_id}``), never the raw path: ids
and random paths would each make a new series (12,000 keyless requests to random paths once grew
``/metrics`` to 71 MB and a scrape to 6 s). A request no route matched is counted under one label,
``UNMATCHED``. Other metric modules (vLLM's metric names) register on ``GatewayMetrics.registry`` and
label by ``endpoint_label(scope)``, so they stay bounded the same way.

The queue's gauges (``pagestream_queue_*``, per model and lane: what vLLM has no notion of) are read from
Redis when ``/metrics`` is scraped (``QueueGauges.refresh``, through ``protocol/queue_state.py``): at most ``MAX_QUEUE_MODELS`` models, two
commands per lane stream, within ``QUEUE_REFRESH_TIMEOUT_S``; Redis down or slow leaves them out, and the
rest of ``/metrics`` still answers. The admission check (``max_queue_depth``) reads the same figures
(``queue_state``). The shared, model-less lanes (jobs submitted without a model, read by workers started
without ``--served-model-name``) are there too, as ``model_name=""`` and ``lane="shared:<lane>"``
(``SHARED_LANE_PREFIX``), so a dashboard or an autoscaler sees a queue no model's series counts.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagestream.producer.gateway.vllm_metrics import VllmMetrics
from pagestream.producer.protocol.queue_state import LaneQueue, ModelQueue, fleet_queues, queue_state

log = logging.getLogger(__name__)

#: how long a scrape waits for the queue's figures before it answers without them
QUEUE_REFRESH_TIMEOUT_S = 1.0
#: a scrape within this long of the last refresh reuses its figures
QUEUE_REFRESH_MIN_S = 0.25

#: the lane label of the shared, model-less lanes' series (``model_name=""``): ``shared:high`` and so on
SHARED_LANE_PREFIX = "shared:"

#: the endpoint label of a request that matched no route (an unknown path: 404)
UNMATCHED = "unmatched"


def endpoint_label(scope: dict[str, Any]) -> str:
    """The route template a request matched (set on the ASGI scope by the router), else ``UNMATCHED``."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pagestream_gateway_requests", "HTTP requests by endpoint (route template) and status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("pagestream_gateway_request_seconds", "Time to the full response (non-streaming) or the last event",
                                 ["endpoint"], registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.streams = Gauge("pagestream_gateway_open_streams", "Streaming responses in progress", registry=r)
        self.disconnect_cancels = Counter("pagestream_gateway_disconnect_cancels", "Jobs cancelled because their client went away", registry=r)
        self.vllm = VllmMetrics(r)  # vLLM's request-level names beside ours (issue 24)
        self.queue = QueueGauges(r)  # the queue per model and lane, read from Redis at each scrape

    def observe_request(self, scope: dict[str, Any], status: int, seconds: float | None) -> None:
        """One answered request; ``seconds`` only for one answered in one body (streams time themselves)."""
        endpoint = endpoint_label(scope)
        self.requests.labels(endpoint, str(status)).inc()
        if seconds is not None:
            self.latency.labels(endpoint).observe(seconds)


class QueueGauges:
    """``pagestream_queue_depth`` / ``_pending`` / ``_oldest_age_seconds`` {model_name, lane} and
    ``pagestream_model_served`` {model_name}, set at each scrape (the shared lanes: ``model_name=""``,
    ``lane="shared:<lane>"``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels, r = ["model_name", "lane"], registry
        self.depth = Gauge("pagestream_queue_depth", "Jobs queued for a model on a lane that no worker has taken yet "
                           "(the consumer group's lag, over every shard stream)", labels, registry=r)
        self.pending = Gauge("pagestream_queue_pending", "Jobs a worker has taken and not yet acknowledged (in flight)",
                             labels, registry=r)
        self.oldest_age = Gauge("pagestream_queue_oldest_age_seconds",
                                "Age of the oldest job no worker has taken yet (0 when none waits)", labels, registry=r)
        self.served = Gauge("pagestream_model_served", "1 while some live worker announces it serves the model, 0 once "
                            "every announcement ran out (its workers gone: its queue only grows)", ["model_name"], registry=r)
        self._lock = asyncio.Lock()
        self._at = float("-inf")

    async def refresh(self, producer: Any, timeout_s: float = QUEUE_REFRESH_TIMEOUT_S) -> None:
        """Read every announced model's lanes (at most ``MAX_QUEUE_MODELS``) within ``timeout_s``; on a failure or
        a timeout the gauges are dropped (absent, never stale) and the scrape goes on without them."""
        async with self._lock:  # concurrent scrapes share one read
            if time.monotonic() - self._at < QUEUE_REFRESH_MIN_S:
                return
            try:
                figures, shared = await asyncio.wait_for(self._read(producer), timeout_s)
            except Exception as exc:  # Redis down, slow or failing: /metrics answers without the queue
                log.debug("queue gauges not refreshed: %s", type(exc).__name__)
                for g in (self.depth, self.pending, self.oldest_age, self.served):
                    g.clear()
                self._at = float("-inf")
                return
            self._at = time.monotonic()
            now_ms = time.time() * 1000
            for g in (self.depth, self.pending, self.oldest_age, self.served):
                g.clear()  # a model no longer in the registry leaves no series behind
            rows = [((model, lane), q) for model, mq in figures.items() for lane, q in mq.lanes.items()]
            rows += [(("", SHARED_LANE_PREFIX + lane), q) for lane, q in shared.items()]
            for model, mq in figures.items():
                self.served.labels(model).set(1 if mq.served(now_ms) else 0)
            for labels, q in rows:
                self.depth.labels(*labels).set(q.depth)
                self.pending.labels(*labels).set(q.pending)
                age = 0.0 if q.oldest_ms is None else max(0.0, (now_ms - q.oldest_ms) / 1000)
                self.oldest_age.labels(*labels).set(age)

    @staticmethod
    async def _read(producer: Any) -> tuple[dict[str, ModelQueue], dict[str, LaneQueue]]:
        """Each announced model's lanes, and the shared ones: a shared lane has no model to announce it."""
        layout = await producer.layout()
        return await fleet_queues(producer.redis, layout), await queue_state(producer.redis, layout, None)


def _family(line: bytes) -> bytes | None:
    """The family a ``# HELP`` / ``# TYPE`` line names (None for any other line)."""
    parts = line.split(None, 3)
    return parts[2] if len(parts) >= 3 and parts[0] == b"#" and parts[1] in (b"HELP", b"TYPE") else None


def append_exposition(own: bytes, other: bytes) -> bytes:
    """``own`` (Prometheus text) followed by the families of ``other`` that ``own`` does not hold: a family
    named twice in one exposition makes Prometheus refuse the whole scrape."""
    have = {f for f in map(_family, own.splitlines()) if f is not None}
    out, keep = [], True
    for line in other.splitlines():
        name = _family(line)
        if name is not None:
            keep = name not in have
        if keep and line.strip():
            out.append(line)
    if not out:
        return own
    return own + (b"" if own.endswith(b"\n") or not own else b"\n") + b"\n".join(out) + b"\n"


async def fetch_exposition(client: Any, url: str, timeout_s: float) -> bytes:
    """Another process's ``/metrics`` (``pagestream serve``: its worker's), or nothing when it does not answer
    within ``timeout_s`` (the worker loading its model, stopped, or gone: the gateway's own series still answer)."""
    try:
        resp = await client.get(url, timeout=timeout_s)
    except Exception as exc:  # httpx's errors, a refused connection, a timeout
        log.debug("no metrics from %s: %s", url, type(exc).__name__)
        return b""
    return resp.content if resp.status_code == 200 else b""
