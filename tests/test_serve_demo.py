"""Issue 28, acceptance 5: ``make demo`` (and ``serve``) run on a Redis of their own unless REDIS_URL
names one: a Redis answering on localhost:6379 (whose db 0 may hold someone else's queue) is not
taken; and the demo exits without triton's nanobind leak lines."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from pagestream.worker import demo
from queue_helpers import ROOT
from test_gateway import DB_URL


def _localhost_answers() -> bool:
    try:
        return bool(redis.Redis(host="localhost", port=6379, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def test_without_redis_url_the_demo_starts_its_own_redis_even_when_localhost_answers(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("PAGESTREAM_REDIS_URL", raising=False)
    assert _localhost_answers()  # the situation of the issue: a Redis is already on localhost:6379
    url, embedded = demo.ensure_redis(announce=False)
    try:
        assert embedded is not None and ":6379" not in url
        assert redis.Redis.from_url(url).dbsize() == 0  # empty: nobody else's jobs
    finally:
        demo._stop(embedded)


def test_redis_url_is_taken_as_given(monkeypatch):
    monkeypatch.setenv("REDIS_URL", DB_URL)
    assert demo.ensure_redis() == (DB_URL, None)


@pytest.mark.slow
def test_make_demo_runs_its_own_jobs_and_exits_quietly():
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "PAGESTREAM_REDIS_URL")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "pagestream.worker.demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "started an embedded redis-server" in text and "localhost:6379" not in text
    assert text.count("-- completed") == len(demo.PROMPTS), text[-3000:]
    assert "nanobind" not in text and "leaked" not in text, text[-3000:]
