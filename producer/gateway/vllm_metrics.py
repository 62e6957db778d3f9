"""vLLM's request-level metrics (``vllm:*``), with vLLM's names, types, ``model_name`` label and buckets, so vLLM's
Grafana dashboard and autoscaling rules read a pagestream gateway as they read ``vllm serve``.

The gateway observes what a request's client sees (time to first token, inter-token latency, end-to-end latency,
tokens in and out, finish reasons) and, from each job's result, the queue and inference time the worker reported.
The engine's gauges (running/waiting requests, KV cache usage, prefix cache, preemptions) are the worker's
(``worker/metrics.py``): each process exports what it measures, nothing is counted twice.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pagestream.producer.protocol.openai import finish_reason
from pagestream.producer.protocol.schema import JobResult

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                           480.0, 960.0, 1920.0, 7680.0)
#: finish reasons vLLM counts (``vllm:request_success_total{finished_reason}``)
FINISHED_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return tuple(out)
            out.append(v)
        exponent += 1


class VllmMetrics:
    """The ``vllm:*`` series one gateway exports, beside pagestream's own on the same registry."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int = 131072) -> None:
        r, labels = registry, ["model_name"]
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels,
                             buckets=ITL_BUCKETS, registry=r)
        # the older name vLLM's published dashboard still queries
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              labels, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels,
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                                    labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", labels,
                                        buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                                      labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                                     labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels,
                                               buckets=token_buckets, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                                   labels, buckets=token_buckets, registry=r)
        self.request_max_generation_tokens = Histogram("vllm:request_max_num_generation_tokens",
                                                       "Histogram of maximum number of requested generation tokens.", labels,
                                                       buckets=token_buckets, registry=r)
        self.request_params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", labels,
                                          buckets=(1, 2, 5, 10, 20), registry=r)
        self.request_params_max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                                   labels, buckets=token_buckets, registry=r)

    def observe_result(self, model: str, result: JobResult, *, n: int, max_tokens: int | None, arrived: float,
                       finished: float, first_token: float | None = None, last_token: float | None = None) -> None:
        """One finished job of a request: tokens, finish reasons, latencies (unix seconds)."""
        self.prompt_tokens.labels(model).inc(result.prompt_tokens)
        self.generation_tokens.labels(model).inc(result.completion_tokens)
        for s in result.outputs or []:
            reason = finish_reason(s.finish_reason) or "abort"
            self.request_success.labels(model, reason).inc()
        self.request_prompt_tokens.labels(model).observe(result.prompt_tokens)
        self.request_generation_tokens.labels(model).observe(result.completion_tokens)
        self.request_max_generation_tokens.labels(model).observe(max_tokens if max_tokens is not None else result.completion_tokens)
        if max_tokens is not None:
            self.request_params_max_tokens.labels(model).observe(max_tokens)
        self.request_params_n.labels(model).observe(n)
        self.e2e.labels(model).observe(max(0.0, finished - arrived))
        if result.started_at is not None and result.created_at is not None:
            self.queue_time.labels(model).observe(max(0.0, result.started_at - result.created_at))
            self.inference_time.labels(model).observe(max(0.0, result.finished_at - result.started_at))
            if first_token is not None:
                # what the gateway can tell apart: prefill until the first token reached it, decode after
                self.prefill_time.labels(model).observe(max(0.0, first_token - result.started_at))
                self.decode_time.labels(model).observe(max(0.0, result.finished_at - first_token))
        if first_token is not None:
            self.ttft.labels(model).observe(max(0.0, first_token - arrived))
            tokens = result.completion_tokens
            if last_token is not None and tokens > 1:
                per_token = max(0.0, last_token - first_token) / (tokens - 1)
                self.itl.labels(model).observe(per_token)
                self.tpot.labels(model).observe(per_token)
