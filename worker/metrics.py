"""Prometheus metrics of one worker (``pagestream worker --metrics-port 9400``).

Updated from the loop once per step or per finished job (a few attribute
increments), exported by prometheus-client's own HTTP thread.
"""
from __future__ import annotations

import time
from typing import Any

import threading
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler


#: seconds over which the snapshot's ``tokens_per_s`` is measured
RATE_WINDOW_S = 2.0

#: vLLM's buckets for ``vllm:iteration_tokens_total`` (vllm/v1/metrics/loggers.py)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
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
        # read from the engine at scrape time (``watch_engine``), not from the half-second snapshot:
        # blocks a cancel frees show at once, which is how a user checks that an abort let them go
        self.kv_free_blocks = Gauge("pagestream_kv_free_blocks", "KV blocks in the engine's free pool now", registry=r)

        # vLLM's engine-side names (issue 24), labelled by the served model as vLLM labels them; the request-level
        # ones (latencies, tokens, finish reasons) are the gateway's (producer/gateway/vllm_metrics.py)
        self.model_name = model_name
        m = ["model_name"]
        self.vllm_running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", m, registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m, registry=r)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m, registry=r)
        # the name vLLM's published Grafana dashboard still queries
        self.vllm_gpu_cache_usage = Gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", m,
                                          registry=r)
        self.vllm_prefix_queries = Counter("vllm:prefix_cache_queries",
                                           "Prefix cache queries, in terms of number of queried tokens.", m, registry=r)
        self.vllm_prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                        m, registry=r)
        self.vllm_preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", m, registry=r)
        # one observation per engine step: the tokens it computed (prompt chunks + one per decoding sequence)
        self.vllm_iteration_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                               m, buckets=ITERATION_TOKENS_BUCKETS, registry=r)
        self._engine_seen = {"q": 0, "h": 0, "p": 0}
        self._tokens_seen = 0
        self._rate_mark = (time.monotonic(), 0)  # (when, tokens then): tokens/s over the last RATE_WINDOW_S
        self._tokens_per_s = 0.0

    def watch_engine(self, engine: Any) -> None:
        """Make ``pagestream_kv_free_blocks`` read the engine's free pool at each scrape."""
        bm = getattr(engine, "block_manager", None)
        if bm is not None:  # one len() on the free list: safe and cheap from the metrics thread
            self.kv_free_blocks.set_function(lambda: bm.num_free_blocks)
        else:  # the fake engine: its stats are a few integers
            self.kv_free_blocks.set_function(lambda: engine.stats().num_free_blocks)

    def observe_step(self, seconds: float, iteration_tokens: list[int] = ()) -> None:
        """One ``engine.step()`` call; ``iteration_tokens``: the engine's steps it took in (``take_iteration_tokens``:
        one each in process; an engine process may have run several, or none, since the last call)."""
        self.steps.inc()
        self.step_seconds.observe(seconds)
        if iteration_tokens:
            hist = self.vllm_iteration_tokens.labels(self.model_name)
            for n in iteration_tokens:
                hist.observe(n)

    def observe(self, st: Any, held: int, num_steps: int, num_completed: int) -> dict[str, Any]:
        """Gauges from the engine's ``EngineStats``; returns the snapshot ``pagestream stats`` shows."""
        self.tokens.inc(max(0, st.num_generated_tokens - self._tokens_seen))
        self._tokens_seen = st.num_generated_tokens
        self.running.set(st.num_running + st.num_waiting)
        self.held.set(held)
        self.kv_usage.set(st.kv_usage)
        self._observe_vllm(st)
        now = time.monotonic()
        since, tokens_then = self._rate_mark
        if now - since >= RATE_WINDOW_S:
            self._tokens_per_s = max(0, st.num_generated_tokens - tokens_then) / (now - since)
            self._rate_mark = (now, st.num_generated_tokens)
        return {
            # model and tokens/s: what `pagestream top` and the gateway's /dashboard show of a worker
            "model": self.model_name, "generated_tokens": st.num_generated_tokens,
            "tokens_per_s": round(self._tokens_per_s, 1),
            "num_running": st.num_running, "num_waiting": st.num_waiting, "num_free_blocks": st.num_free_blocks,
            "num_total_blocks": st.num_total_blocks, "kv_usage": round(st.kv_usage, 4), "num_steps": num_steps,
            "num_completed": num_completed, "held": held, "updated_at": round(time.time(), 3),
        }

    def _observe_vllm(self, st: Any) -> None:
        name, seen = self.model_name, self._engine_seen
        self.vllm_running.labels(name).set(st.num_running)
        self.vllm_waiting.labels(name).set(st.num_waiting)
        self.vllm_kv_usage.labels(name).set(st.kv_usage)
        self.vllm_gpu_cache_usage.labels(name).set(st.kv_usage)
        for key, counter, now in (("q", self.vllm_prefix_queries, st.prefix_cache_queries),
                                  ("h", self.vllm_prefix_hits, st.prefix_cache_hits),
                                  ("p", self.vllm_preemptions, st.num_preemptions)):
            counter.labels(name).inc(max(0, now - seen[key]))
            seen[key] = max(seen[key], now)

    def serve(self, port: int, addr: str = "127.0.0.1") -> ThreadingHTTPServer:
        """Prometheus text on ``http://addr:port/metrics`` only (404 elsewhere), from a daemon thread."""
        registry = self.registry

        class Handler(MetricsHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                super().do_GET()

            def log_message(self, *args) -> None:  # scrapes are not news
                pass

        Handler.registry = registry
        server = ThreadingHTTPServer((addr, port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="pagestream-metrics", daemon=True).start()
        return server
