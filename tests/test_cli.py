"""The ``pagestream`` CLI as a user runs it: subprocesses against a real Redis and a worker process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import redis

from pagestream.producer.protocol import keys
from tests.queue_helpers import ROOT, WorkerProc, wait_for
from zygote import run, spawn


def cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "pagestream.worker.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def fake_worker(redis_url, tmp_path):
    w = WorkerProc(redis_url, "fake:2", "cli-w", log_dir=tmp_path)
    w.wait_ready(30)
    yield w
    assert w.stop() == 0


def test_submit_json_stream_tail_and_stats(redis_url, fake_worker):
    out = cli("submit", "--redis-url", redis_url, "hello world", "--max-tokens", "5", "--seed", "7", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["status"] == "completed" and len(res["token_ids"]) == 5 and res["worker"] == "cli-w"

    # REDIS_URL is the default for --redis-url; --stream prints the same text live
    out = cli("submit", "hello world", "--max-tokens", "5", "--seed", "7", "--stream", env={"REDIS_URL": redis_url})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == res["text"]

    out = cli("tail", res["job_id"], "--redis-url", redis_url)
    assert out.returncode == 0 and out.stdout.strip() == res["text"]
    assert "completed" in out.stderr

    r = redis.Redis.from_url(redis_url)
    r.xadd(keys.jobs_stream("normal"), {"job": b"\xff not json"})
    out = cli("submit", "--redis-url", redis_url, "after the bad one", "--max-tokens", "2")
    assert out.returncode == 0
    out = cli("stats", "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    assert "normal" in out.stdout and "cli-w" in out.stdout and "dead letters: 1" in out.stdout
    data = json.loads(cli("stats", "--redis-url", redis_url, "--json").stdout)
    assert data["lanes"]["normal"]["pending"] == 0 and data["dead_letters"] == 1
    # the rate counts the last 10 full seconds, so a job done in the current one shows from the next; on a busy
    # machine the earlier jobs may be out of the window by now
    wait_for(lambda: json.loads(cli("stats", "--redis-url", redis_url, "--json").stdout)["lanes"]["normal"]["jobs_per_s"] > 0,
             5, "a rate over the jobs just done")


def test_events_prints_filters_and_follows_the_firehose_until_ctrl_c(redis_url):
    from pagestream.producer import Producer

    with Producer.from_url(redis_url) as p:
        a = p.submit(prompt="events one", max_tokens=1)
        b = p.submit(prompt="events two", max_tokens=1)
        p.cancel(a)
        out = cli("events", "--redis-url", redis_url)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert [(ln.split()[3], ln.split()[4]) for ln in lines] == [("queued", a), ("queued", b), ("cancelled", a)]
        assert "lane=normal" in lines[0]
        out = cli("events", "--redis-url", redis_url, "--job", a, "--json")
        evs = [json.loads(ln) for ln in out.stdout.splitlines()]
        assert [(e["type"], e["job"]) for e in evs] == [("queued", a), ("cancelled", a)]
        assert evs[0]["id"] and isinstance(evs[0]["ts"], float)
        out = cli("events", "--redis-url", redis_url, "--type", "cancelled", "--type", "finished", "--json")
        assert [json.loads(ln)["job"] for ln in out.stdout.splitlines()] == [a]
        out = cli("events", "--redis-url", redis_url, "--type", "finishd")
        assert out.returncode == 2 and "finishd" in out.stderr
        # --follow from an id: what came after it, then what comes next, until Ctrl-C (exit 0)
        proc = spawn([sys.executable, "-m", "pagestream.worker.cli", "events", "--redis-url", redis_url, "--follow",
                      "--from", evs[0]["id"], "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True, env=dict(os.environ))
        got: list[dict] = []
        reader = threading.Thread(target=lambda: got.extend(json.loads(ln) for ln in proc.stdout), daemon=True)
        reader.start()
        try:
            c = p.submit(prompt="events three", max_tokens=1)
            wait_for(lambda: any(e["job"] == c for e in got), 30, "the followed event")
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                code, why = proc.wait(15), ""
            except subprocess.TimeoutExpired:
                proc.kill()
                code, why = None, f"still running 15 s after SIGINT; its stderr: {proc.communicate()[1]}"
            assert code == 0, why or proc.stderr.read()
        reader.join(5)
        assert [(e["type"], e["job"]) for e in got] == [("queued", b), ("cancelled", a), ("queued", c)]


def test_submit_bad_input_is_a_clear_error(redis_url):
    out = cli("submit", "--redis-url", redis_url, "hi", "--temperature", "-1")
    assert out.returncode == 2 and "temperature" in out.stderr
    out = cli("submit", "--redis-url", redis_url, "hi", "--lane", "urgent")
    assert out.returncode == 2 and "lane" in out.stderr
    assert redis.Redis.from_url(redis_url).xlen(keys.jobs_stream("normal")) == 0


def test_producer_commands_do_not_import_torch_or_the_engine(redis_url):
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from worker.cli import app\n"
        f"r = CliRunner().invoke(app, ['submit', '--redis-url', '{redis_url}', 'x', '--no-wait'])\n"
        "assert r.exit_code == 0, r.output\n"
        f"r = CliRunner().invoke(app, ['stats', '--redis-url', '{redis_url}'])\n"
        "assert r.exit_code == 0, r.output\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'engine'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_demo_starts_an_embedded_redis_when_none_answers(monkeypatch):
    import pagestream.worker.demo as demo

    monkeypatch.delenv("REDIS_URL", raising=False)
    real = demo._answers
    monkeypatch.setattr(demo, "_answers", lambda url: False if url == "redis://localhost:6379/0" else real(url))
    url, embedded = demo.ensure_redis()
    try:
        assert embedded is not None and url != "redis://localhost:6379/0"
        assert redis.Redis.from_url(url).ping()
    finally:
        demo._stop(embedded)
    assert not real(url)


def test_worker_serves_prometheus_metrics(redis_url, tmp_path):
    import socket
    import urllib.request

    from pagestream.producer import Producer
    from tests.queue_helpers import wait_for

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = WorkerProc(redis_url, "fake", "metrics-w", "--metrics-port", str(port), log_dir=tmp_path)
    try:
        w.wait_ready(30)
        with Producer.from_url(redis_url) as p:
            ids = [p.submit(prompt=f"m {i}", max_tokens=4) for i in range(3)]
            for j in ids:
                p.result(j, timeout=10)
        r = redis.Redis.from_url(redis_url)
        r.xadd(keys.jobs_stream("normal"), {"job": b"garbage"})

        def scrape() -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

        def scraped_after_dead_letter() -> str | None:
            text = scrape()
            return text if "pagestream_dead_letters_total 1.0" in text else None

        text = wait_for(scraped_after_dead_letter, 10, "the dead letter in the metrics")
        assert 'pagestream_jobs_total{status="completed"} 3.0' in text
        assert 'pagestream_jobs_total{status="failed"} 1.0' in text
        assert "pagestream_engine_step_seconds_count" in text
    finally:
        assert w.stop() == 0
