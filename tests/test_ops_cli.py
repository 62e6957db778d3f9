"""Operations commands as a user runs them (issue 13): cancel, status, dlq list|show|retry, bulk list,
--version, stale consumers leaving `stats`; against a real Redis, error paths included."""
from __future__ import annotations

import json

import pytest
import redis

from pagestream.producer import Producer
from pagestream.producer.protocol import keys
from pagestream.worker.consumer import Consumer
from pagestream.worker.settings import WorkerSettings
from tests.queue_helpers import WorkerProc, wait_for
from tests.test_cli import cli


def one_error_line(out, code: int = 2) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    return lines[0]


def test_version():
    from pagestream import __version__

    out = cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"pagestream {__version__}"


def test_cancel_and_status_of_a_queued_job(redis_url):
    with Producer.from_url(redis_url) as p:
        job_id = p.submit(prompt="never run", max_tokens=3, lane="high")
    out = cli("status", job_id, "--redis-url", redis_url)
    assert out.returncode == 0 and "queued" in out.stdout and "lane=high" in out.stdout, out.stderr
    out = cli("cancel", job_id, "--redis-url", redis_url)
    assert out.returncode == 0 and out.stdout.strip() == f"{job_id}: cancelled", out.stderr
    with Producer.from_url(redis_url) as p:
        res = p.result(job_id, timeout=5)  # a waiting reader is released at once
        assert res.status.value == "cancelled"
    # PAGESTREAM_REDIS_URL works for these commands as for every other
    out = cli("status", job_id, "--json", env={"PAGESTREAM_REDIS_URL": redis_url, "REDIS_URL": "redis://127.0.0.1:1/0"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "cancelled"
    out = cli("cancel", job_id, "--redis-url", redis_url)
    assert out.returncode == 0 and "already cancelled" in out.stdout


@pytest.mark.parametrize("command", ["cancel", "status"])
def test_unknown_job_is_one_line_and_exit_2(redis_url, command):
    line = one_error_line(cli(command, "no-such-job", "--redis-url", redis_url))
    assert "no job no-such-job" in line


def _dead_letter_a_real_job(redis_url: str) -> tuple[str, str]:
    """A job submitted by the producer, read by a worker's consumer and dead-lettered by it."""
    with Producer.from_url(redis_url) as p:
        job_id = p.submit(prompt="second chance", max_tokens=4, seed=1)
    client = redis.Redis.from_url(redis_url)
    consumer = Consumer(client, WorkerSettings(redis_url=redis_url, consumer="doomed", lanes=["normal"]))
    consumer.ensure_groups()
    (delivery,) = consumer.read(10)
    consumer.dead_letter(delivery, "failed 3 deliveries (injected)", job_id=job_id)
    ((dlq_id, _),) = client.xrange(keys.dead_letter_stream())
    return job_id, dlq_id.decode()


def test_dlq_list_show_retry_runs_the_job_again(redis_url, tmp_path):
    job_id, dlq_id = _dead_letter_a_real_job(redis_url)
    r = redis.Redis.from_url(redis_url)
    r.xadd(keys.jobs_stream("low"), {"junk": b"\xff"})  # raw junk: the worker dead-letters it too

    out = cli("dlq", "list", "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(dlq_id) and job_id in out.stdout and "injected" in out.stdout
    shown = json.loads(cli("dlq", "show", dlq_id, "--redis-url", redis_url).stdout)
    assert shown["job_id"] == job_id and json.loads(shown["payload"]["job"])["prompt"] == "second chance"

    out = cli("dlq", "retry", dlq_id, "--redis-url", redis_url)
    assert out.returncode == 0 and out.stdout.strip() == job_id, out.stderr
    w = WorkerProc(redis_url, "fake", "dlq-w", log_dir=tmp_path)
    try:
        w.wait_ready(30)
        with Producer.from_url(redis_url) as p:
            res = p.result(job_id, timeout=30)
        assert res.status.value == "completed" and len(res.token_ids) == 4
        out = cli("status", job_id, "--redis-url", redis_url)
        assert out.returncode == 0 and "completed" in out.stdout and "worker: dlq-w" in out.stdout
        # the junk entry is now the only dead letter; it is not a job and cannot be retried
        junk_id = wait_for(lambda: [e for e in r.xrange(keys.dead_letter_stream())], 20, "junk dead-lettered")[0][0].decode()
        assert r.xlen(keys.dead_letter_stream()) == 1
        line = one_error_line(cli("dlq", "retry", junk_id, "--redis-url", redis_url))
        assert junk_id in line and "not a job" in line
    finally:
        assert w.stop() == 0
    line = one_error_line(cli("dlq", "show", "1-1", "--redis-url", redis_url))
    assert "no dead letter 1-1" in line
    one_error_line(cli("dlq", "retry", "not-an-id", "--redis-url", redis_url))


def test_bulk_list_and_missing_input_file(redis_url, tmp_path):
    missing = tmp_path / "nope.jsonl"
    line = one_error_line(cli("bulk", "submit", str(missing), "--out", str(tmp_path / "out"), "--redis-url", redis_url))
    assert str(missing) in line
    assert redis.Redis.from_url(redis_url).zcard(keys.bulk_index()) == 0

    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "body": {"prompt": "hi"}}\n')
    ids = []
    for _ in range(2):
        out = cli("bulk", "submit", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out"), "--redis-url", redis_url)
        assert out.returncode == 0, out.stderr
        ids.append(out.stdout.strip())
    out = cli("bulk", "list", "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()
    assert [row.split()[0] for row in rows] == ids[::-1] and all("validating" in row for row in rows)
    out = cli("bulk", "list", "--json", "--limit", "1", "--redis-url", redis_url)
    assert [json.loads(x)["id"] for x in out.stdout.splitlines()] == [ids[1]]


def test_stopped_and_stale_consumers_leave_stats(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    # a consumer from a worker that died long ago, holding nothing
    Consumer(r, WorkerSettings(redis_url=redis_url, consumer="ghost")).ensure_groups()
    r.xreadgroup(keys.DEFAULT_GROUP, "ghost", {keys.jobs_stream("normal"): ">"}, count=1)
    w = WorkerProc(redis_url, "fake", "live-w", env={"PAGESTREAM_STALE_CONSUMER_MS": "1000", "PAGESTREAM_TRIM_INTERVAL_S": "0.5"},
                   log_dir=tmp_path)
    try:
        w.wait_ready(30)

        def consumers() -> set[str]:
            return {c["name"] for c in json.loads(cli("stats", "--json", "--redis-url", redis_url).stdout)["lanes"]["normal"]["consumers"]}

        wait_for(lambda: consumers() == {"live-w"}, 30, "ghost removed, live worker kept", interval=0.5)
    finally:
        assert w.stop() == 0
    assert consumers() == set()  # a clean stop leaves nothing behind
