"""The gateway's Prometheus metrics (served on its own ``/metrics``)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagestream.producer.gateway.vllm_metrics import VllmMetrics


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pagestream_gateway_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.latency = Histogram("pagestream_gateway_request_seconds", "Time to the full response (non-streaming) or the last event",
                                 ["endpoint"], registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.streams = Gauge("pagestream_gateway_open_streams", "Streaming responses in progress", registry=r)
        self.disconnect_cancels = Counter("pagestream_gateway_disconnect_cancels", "Jobs cancelled because their client went away", registry=r)
        self.vllm = VllmMetrics(r)  # vLLM's request-level names beside ours (issue 24)
