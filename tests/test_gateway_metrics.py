"""``/metrics`` stays bounded under hostile traffic (issue 22, "Why" 3 and acceptance 3): labels are route
templates, never raw paths or ids; an unknown path is a 404 without a new series; a scrape stays fast and the
gateway's memory flat. Against a gateway process with API keys and a real Redis, with keyless requests."""
from __future__ import annotations

import random
import statistics
import string
import time

import httpx
import pytest
import redis

from gateway_helpers import DB_URL, GatewayProc


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    r = redis.Redis.from_url(DB_URL)
    r.flushdb()
    proc = GatewayProc(DB_URL, "--api-keys", "metrics-key-1:team", log_dir=tmp_path_factory.mktemp("metrics"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
        r.flushdb()
        r.close()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def random_requests(rng: random.Random, n: int):
    word = lambda k: "".join(rng.choices(string.ascii_lowercase + string.digits, k=k))  # noqa: E731
    shapes = [
        lambda: ("GET", f"/{word(12)}/{word(8)}"),
        lambda: ("POST", f"/v1/{word(10)}"),
        lambda: ("GET", f"/v1/files/file-{word(24)}"),  # a real template with a fresh id: 401 without a key
        lambda: ("GET", f"/v1/files/file-{word(24)}/content"),
        lambda: ("DELETE", f"/v1/batches/batch_{word(24)}"),  # a route without DELETE: 405
        lambda: ("POST", f"/v1/batches/batch_{word(24)}/cancel"),
        lambda: ("GET", f"/v1/models/{word(6)}?x={word(5)}"),
    ]
    for _ in range(n):
        yield rng.choice(shapes)()


def timed(client: httpx.Client, url: str) -> tuple[float, httpx.Response]:
    t0 = time.perf_counter()
    resp = client.get(url)
    return time.perf_counter() - t0, resp


def test_random_keyless_paths_keep_metrics_flat_and_fast(gw):
    root = gw.base_url.rsplit("/v1", 1)[0]
    rng = random.Random(22)
    with httpx.Client(base_url=root, timeout=30) as c:
        sent: list[str] = []

        def blast(n: int) -> None:
            for method, path in random_requests(rng, n):
                resp = c.request(method, path)
                assert resp.status_code in (401, 404, 405), (method, path, resp.status_code, resp.text)
                assert "error" in resp.json()
                sent.append(path)

        blast(300)  # every shape (and status) seen once: the series that will ever exist
        c.get("/health"), c.get("/metrics")
        warm_size, warm_rss = len(c.get("/metrics").content), rss_bytes(gw.proc.pid)
        health: list[float] = []
        for _ in range(10):
            blast(200)
            health.append(timed(c, "/health")[0])
        text = c.get("/metrics").text
        size, rss = len(text), rss_bytes(gw.proc.pid)
        scrapes = [timed(c, "/metrics")[0] for _ in range(5)]

    assert len(sent) == 2300
    assert size <= warm_size * 1.10, (warm_size, size)  # no series per path: only the counts grew
    assert rss <= warm_rss * 1.10, (warm_rss, rss)
    series = [line for line in text.splitlines() if line.startswith("pagestream_gateway_requests_total{")]
    assert len(series) <= 20, series
    assert 'endpoint="/v1/files/{file_id}"' in text and 'endpoint="unmatched"' in text
    for path in sent[::50]:
        assert path.split("?")[0] not in text  # neither random paths nor ids become labels
    assert statistics.median(scrapes) < 0.050, scrapes
    assert statistics.median(health) < 0.020, health


def _queue_gauges(text: str) -> dict[str, dict[tuple[str, str], float]]:
    """pagestream_queue_{depth,pending,oldest_age_seconds} by (model_name, lane), parsed as Prometheus parses them."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[tuple[str, str], float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("pagestream_queue_") and fam.type == "gauge":
            out[fam.name] = {(s.labels["model_name"], s.labels["lane"]): s.value for s in fam.samples}
    return out


def _announce(r: redis.Redis, model: str, for_s: float = 600) -> None:
    """``model`` in the registry as a worker announces it (no worker runs it yet)."""
    from pagestream.producer.protocol import keys

    r.zadd(keys.model_registry(), {model: int((time.time() + for_s) * 1000)})


def test_queue_depth_pending_and_age_per_model_and_lane_are_read_from_redis_at_each_scrape(gw, tmp_path):
    from pagestream.producer import JobStatus, Producer
    from queue_helpers import WorkerProc, wait_for

    model = "queued-model"
    r = redis.Redis.from_url(DB_URL)
    _announce(r, model)
    producer = Producer(r)
    jobs = [producer.submit(prompt=f"wait {i}", max_tokens=2, model=model) for i in range(5)]
    jobs.append(producer.submit(prompt="urgent", max_tokens=2, model=model, lane="high"))
    root = gw.base_url.rsplit("/v1", 1)[0]
    time.sleep(0.3)  # past the window in which a scrape reuses the last one's figures (QUEUE_REFRESH_MIN_S)
    first = _queue_gauges(httpx.get(f"{root}/metrics", timeout=10).text)
    depth, pending, age = (first[f"pagestream_queue_{n}"] for n in ("depth", "pending", "oldest_age_seconds"))
    shared_zero = {("", f"shared:{lane}"): 0 for lane in ("high", "normal", "low")}  # nothing on the shared lanes
    assert depth == {(model, "high"): 1, (model, "normal"): 5, (model, "low"): 0, **shared_zero}
    assert pending == {(model, "high"): 0, (model, "normal"): 0, (model, "low"): 0, **shared_zero}
    assert age[(model, "low")] == 0 and 0 <= age[(model, "normal")] < 30
    time.sleep(1.2)
    later = _queue_gauges(httpx.get(f"{root}/metrics", timeout=10).text)["pagestream_queue_oldest_age_seconds"]
    assert later[(model, "normal")] >= age[(model, "normal")] + 1.0  # the oldest job waits on: its age grows
    assert later[(model, "high")] >= 1.0

    # a worker for the model takes them all: nothing waits, nothing is in flight
    worker = WorkerProc(DB_URL, "fake:1", "queue-gauges-w", "--served-model-name", model, log_dir=tmp_path)
    try:
        worker.wait_ready()
        assert all(producer.result(j, timeout=60).status == JobStatus.COMPLETED for j in jobs)

        def drained() -> bool:
            g = _queue_gauges(httpx.get(f"{root}/metrics", timeout=10).text)
            return all(v == 0 for name in ("depth", "pending", "oldest_age_seconds")
                       for v in g[f"pagestream_queue_{name}"].values())
        wait_for(drained, 30, "the queue gauges at 0 once the worker took every job")
    finally:
        worker.stop()


def test_the_shared_model_less_lanes_have_their_own_queue_gauges(gw, tmp_path):
    """Jobs submitted without a model go to the shared lanes, which no model's series counts: they are
    ``model_name=""``, ``lane="shared:<lane>"``, and drain when a worker without a served model takes them."""
    from pagestream.producer import JobStatus, Producer
    from queue_helpers import WorkerProc, wait_for

    r = redis.Redis.from_url(DB_URL)
    producer = Producer(r)
    jobs = [producer.submit(prompt=f"no model {i}", max_tokens=2) for i in range(3)]
    jobs.append(producer.submit(prompt="no model, later", max_tokens=2, lane="low"))
    root = gw.base_url.rsplit("/v1", 1)[0]
    time.sleep(0.3)  # past the reuse window (QUEUE_REFRESH_MIN_S)
    first = _queue_gauges(httpx.get(f"{root}/metrics", timeout=10).text)
    depth, age = first["pagestream_queue_depth"], first["pagestream_queue_oldest_age_seconds"]
    assert {k: v for k, v in depth.items() if k[0] == ""} == {("", "shared:high"): 0, ("", "shared:normal"): 3,
                                                              ("", "shared:low"): 1}
    assert all(v == 0 for k, v in depth.items() if k[0] != "")  # counted on the shared lanes only
    time.sleep(1.2)
    later = _queue_gauges(httpx.get(f"{root}/metrics", timeout=10).text)["pagestream_queue_oldest_age_seconds"]
    assert later[("", "shared:normal")] >= age[("", "shared:normal")] + 1.0 and later[("", "shared:high")] == 0

    worker = WorkerProc(DB_URL, "fake:1", "queue-gauges-shared", log_dir=tmp_path)  # no model: the shared lanes
    try:
        worker.wait_ready()
        assert all(producer.result(j, timeout=60).status == JobStatus.COMPLETED for j in jobs)

        def drained() -> bool:
            g = _queue_gauges(httpx.get(f"{root}/metrics", timeout=10).text)
            return all(g[f"pagestream_queue_{name}"][("", f"shared:{lane}")] == 0
                       for name in ("depth", "pending", "oldest_age_seconds") for lane in ("high", "normal", "low"))
        wait_for(drained, 30, "the shared lanes' gauges at 0 once a model-less worker took every job")
    finally:
        worker.stop()


def test_metrics_answer_without_the_queue_gauges_while_redis_is_down_or_stuck(tmp_path):
    import os
    import signal

    from pagestream.producer import Producer
    from private_redis import PrivateRedis

    server = PrivateRedis()
    gw = GatewayProc(server.url, log_dir=tmp_path)
    try:
        gw.wait_ready()
        r = redis.Redis.from_url(server.url)
        _announce(r, "m")
        Producer(r).submit(prompt="waits", max_tokens=2, model="m")
        url = f"http://127.0.0.1:{gw.port}/metrics"
        assert _queue_gauges(httpx.get(url, timeout=10).text)["pagestream_queue_depth"][("m", "normal")] == 1
        time.sleep(0.3)  # past the reuse window: the next scrape reads Redis again
        os.kill(server.proc.pid, signal.SIGSTOP)  # Redis stuck: a command never answers
        try:
            t, resp = timed(httpx.Client(timeout=30), url)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert resp.status_code == 200 and t < 3.0, t
        assert "pagestream_queue_depth{" not in resp.text  # absent, not stale
        assert "pagestream_gateway_requests_total{" in resp.text  # the gateway's own series still answer
        server.stop()  # Redis gone: refused at once
        time.sleep(0.3)
        t, resp = timed(httpx.Client(timeout=30), url)
        assert resp.status_code == 200 and t < 3.0, t
        assert "pagestream_queue_depth{" not in resp.text and "pagestream_gateway_requests_total{" in resp.text
        server.start()
        wait_for_gauge = lambda: "pagestream_queue_depth{" in httpx.get(url, timeout=10).text  # noqa: E731
        from queue_helpers import wait_for
        wait_for(wait_for_gauge, 30, "the queue gauges back once Redis is")
    finally:
        gw.stop()
        server.stop()


def test_a_workers_exposition_is_appended_without_the_families_the_gateway_has():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pagestream.producer.gateway.metrics import append_exposition

    gw, wk = CollectorRegistry(), CollectorRegistry()
    Counter("vllm:prompt_tokens", "gateway's", ["model_name"], registry=gw).labels("m").inc(3)
    Counter("vllm:prompt_tokens", "worker's", ["model_name"], registry=wk).labels("m").inc(5)  # a family both have
    Gauge("vllm:num_requests_running", "worker's", ["model_name"], registry=wk).labels("m").set(2)
    merged = append_exposition(generate_latest(gw), generate_latest(wk)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    assert [s.value for s in fams["vllm:prompt_tokens"].samples if s.name.endswith("_total")] == [3.0]  # the gateway's
    assert [s.value for s in fams["vllm:num_requests_running"].samples] == [2.0]
    types = [line.split()[2] for line in merged.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    assert append_exposition(generate_latest(gw), b"") == generate_latest(gw)  # a worker that did not answer
