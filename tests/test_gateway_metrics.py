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
