"""The gateway's Prometheus metrics (served on its own ``/metrics``), their label sets bounded.

An endpoint label is the matched route's template (``/v1/files/{file_id}``), never the raw path: ids
and random paths would each make a new series (12,000 keyless requests to random paths once grew
``/metrics`` to 71 MB and a scrape to 6 s). A request no route matched is counted under one label,
``UNMATCHED``. Other metric modules (vLLM's metric names) register on ``GatewayMetrics.registry`` and
label by ``endpoint_label(scope)``, so they stay bounded the same way.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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

    def observe_request(self, scope: dict[str, Any], status: int, seconds: float | None) -> None:
        """One answered request; ``seconds`` only for one answered in one body (streams time themselves)."""
        endpoint = endpoint_label(scope)
        self.requests.labels(endpoint, str(status)).inc()
        if seconds is not None:
            self.latency.labels(endpoint).observe(seconds)
