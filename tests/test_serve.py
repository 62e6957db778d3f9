"""Issue 28: ``pagestream serve MODEL`` is everything one machine needs.

Acceptance 1: from nothing but the model directory, ``serve`` answers the openai client's chat
completion and runs a Batch API batch to ``completed`` with its output file, no other command
started (its own embedded Redis, worker and bulk-worker); stopping it prints no nanobind leak lines
(acceptance 5). Acceptance 2: ``serve --help`` lists every flag ``worker --help`` lists that is about
the engine or the worker's metrics. Readiness comes from Redis (the worker's heartbeat and
announcement), checked against a real Redis.
"""
from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
import redis
from typer.testing import CliRunner

from pagestream.engine.config import engine_knobs
from pagestream.producer.protocol import keys
from pagestream.worker import cli
from pagestream.worker.readiness import worker_ready
from gateway_helpers import ServeProc
from queue_helpers import wait_for
from test_gateway import DB_URL

#: worker flags that are about one worker's place in a fleet, not something ``serve`` lets a user choose
WORKER_ONLY = {"--consumer", "--lanes", "--lease-ms", "--max-deliveries", "--prefetch", "--publish-interval-ms", "--burst",
               "--metrics-host", "--engine-process", "--no-engine-process", "--redis-url", "--served-model-name", "--model",
               "--log-level", "--help", "--drain-timeout"}


def _flags(command: str) -> set[str]:
    out = CliRunner().invoke(cli.app, [command, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"}).output
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out))


def test_serve_help_lists_every_engine_flag_the_worker_help_lists():
    worker, serve = _flags("worker"), _flags("serve")
    knob_flags = {k.flag for k in engine_knobs()}
    assert knob_flags <= worker
    assert worker - WORKER_ONLY <= serve, (worker - WORKER_ONLY) - serve
    assert {"--metrics-port", "--no-bulk-worker", "--dtype", "--gpu-memory-utilization", "--block-size",
            "--max-num-batched-tokens", "--enforce-eager", "--model"} <= serve
    help_text = CliRunner().invoke(cli.app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert "MODEL" in help_text.split("\n", 3)[1] or "serve [OPTIONS] MODEL" in help_text or "[MODEL]" in help_text


def test_serve_without_a_model_says_so():
    res = CliRunner().invoke(cli.app, ["serve"])
    assert res.exit_code == 2 and "pagestream serve MODEL" in res.output


def test_readiness_is_the_workers_heartbeat_and_announcement_in_redis():
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    try:
        assert not worker_ready(r, "w1", "m")
        r.hset(keys.worker_hash("w1"), mapping={"num_running": 0})
        assert not worker_ready(r, "w1", "m")  # alive but not announcing its model yet
        assert worker_ready(r, "w1", None)
        r.zadd(keys.model_registry(), {"m": int((time.time() - 5) * 1000)})
        assert not worker_ready(r, "w1", "m")  # an expired announcement (a dead worker's) is not readiness
        r.zadd(keys.model_registry(), {"m": int((time.time() + 10) * 1000)})
        assert worker_ready(r, "w1", "m")
        assert not worker_ready(r, "w2", "m")  # another worker's announcement says nothing about ours
    finally:
        r.flushdb()


@pytest.mark.slow
def test_serve_model_alone_answers_chat_and_runs_a_batch_to_completed(smollm2_dir, tmp_path):
    serve = ServeProc(smollm2_dir, "--max-num-seqs", "4", log_dir=tmp_path, redis_url=None,
                      env={"REDIS_URL": None, "PAGESTREAM_REDIS_URL": None, "PAGESTREAM_GATEWAY_FILES_URI": str(tmp_path / "files")})
    try:
        # the banner says ready only once the gateway listens: the first request after it is answered, never refused
        wait_for(lambda: serve.proc.poll() is not None or "files  " in serve.log(), 600, "pagestream serve's banner", interval=0.2)
        start = serve.log()
        assert f"http://127.0.0.1:{serve.port}/v1" in start and "(embedded" in start and "bulk-worker  pid" in start
        assert str(tmp_path / "files") in start
        assert httpx.get(f"http://127.0.0.1:{serve.port}/health", timeout=10).status_code == 200
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{serve.port}/v1", api_key="unused", max_retries=0, timeout=600)
        name = str(smollm2_dir)
        assert [m.id for m in c.models.list()] == [name]
        chat = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, seed=1)
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0

        lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": name, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 6}}
                 for i in range(3)]
        (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        with open(tmp_path / "in.jsonl", "rb") as f:
            up_file = c.files.create(file=f, purpose="batch")
        batch = c.batches.create(input_file_id=up_file.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 300
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"batch stuck in {batch.status}:\n{serve.log()[-3000:]}"
            time.sleep(1)
            batch = c.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts.completed == 3 and batch.output_file_id
        out = [json.loads(x) for x in c.files.content(batch.output_file_id).read().decode().splitlines()]
        assert sorted(o["custom_id"] for o in out) == ["q0", "q1", "q2"]
        assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"][0]["message"]["content"] for o in out)
    finally:
        rc = serve.stop()
    text = serve.log()
    assert rc == 0, text[-3000:]
    assert "nanobind" not in text and "leaked" not in text, text[-3000:]
    assert "stopped after" in text  # the worker warm-stopped and said so


def test_serve_metrics_carry_the_gateways_and_the_workers_series_in_one_scrape(tmp_path):
    """Issue 24: ``pagestream serve``'s /metrics (the gateway's port) holds the gateway's request-level series, the
    queue's gauges and its worker's engine series, each family once; a worker that does not answer leaves its
    series out and the scrape still answers at once."""
    import os
    import signal

    from prometheus_client.parser import text_string_to_metric_families

    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    serve = ServeProc("fake:2", "--no-bulk-worker", "--served-model-name", "served-fake", log_dir=tmp_path)
    try:
        serve.wait_ready(120)
        base = f"http://127.0.0.1:{serve.port}"
        done = httpx.post(f"{base}/v1/completions", json={"model": "served-fake", "prompt": "count my tokens", "max_tokens": 4},
                          timeout=60)
        assert done.status_code == 200, done.text
        m = {"model_name": "served-fake"}

        def scrape() -> tuple[str, dict]:
            text = httpx.get(f"{base}/metrics", timeout=10).text
            return text, {f.name: f for f in text_string_to_metric_families(text)}

        def has(fams: dict, family: str, sample: str) -> bool:
            return family in fams and any(s.name == sample and s.labels == m for s in fams[family].samples)

        # the worker's gauges are set every half second: wait for the first snapshot after the request
        wait_for(lambda: has(scrape()[1], "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"), 30, "the worker's series")
        text, fams = scrape()
        types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)  # each family once
        assert has(fams, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count")  # the gateway's
        assert has(fams, "vllm:num_requests_running", "vllm:num_requests_running")  # the worker's
        assert has(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc")
        steps = [s for s in fams["vllm:iteration_tokens_total"].samples if s.name == "vllm:iteration_tokens_total_sum"]
        assert [s.labels for s in steps] == [m] and steps[0].value == 3 + 4 - 1  # its prompt, then its tokens after the first
        assert {(s.labels["model_name"], s.labels["lane"]) for s in fams["pagestream_queue_depth"].samples} == \
            {("served-fake", lane) for lane in keys.LANES} | {("", f"shared:{lane}") for lane in keys.LANES}
        assert "pagestream_engine_steps_total" in text and "pagestream_gateway_requests_total" in text

        # a worker that does not answer (stopped): the gateway's own series answer, at once
        pid = int(re.search(r"worker\s+pid (\d+)", serve.log()).group(1))
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            text, fams = scrape()
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert took < 3.0, took
        assert "vllm:e2e_request_latency_seconds" in fams and "vllm:num_requests_running" not in fams
    finally:
        rc = serve.stop()
        r.flushdb()
        r.close()
    assert rc == 0, serve.log()[-3000:]
