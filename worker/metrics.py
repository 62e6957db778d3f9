"""Prometheus metrics of one worker (``pagestream worker --metrics-port 9400``).

Updated from the loop once per step or per finished job (a few attribute
increments), exported by prometheus-client's own HTTP thread.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.jobs = Counter("pagestream_jobs", "Jobs finished by this worker, by final status", ["status"], registry=r)
        self.dead_letters = Counter("pagestream_dead_letters", "Entries this worker sent to the dead-letter stream", registry=r)
        self.tokens = Counter("pagestream_generated_tokens", "Output tokens produced by the engine", registry=r)
        self.steps = Counter("pagestream_engine_steps", "Engine steps taken", registry=r)
        self.step_seconds = Histogram(
            "pagestream_engine_step_seconds", "Time inside engine.step()", registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.queue_seconds = Counter("pagestream_queue_loop_seconds", "Loop time outside engine.step() (what the queue costs)", registry=r)
        self.running = Gauge("pagestream_running_jobs", "Jobs in the engine", registry=r)
        self.held = Gauge("pagestream_held_entries", "Lane entries this worker holds unacked (its PEL share)", registry=r)
        self.kv_usage = Gauge("pagestream_kv_usage", "Fraction of KV blocks in use", registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
