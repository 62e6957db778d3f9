"""Hostile Redis contents and leaked secrets (issue 8, items 1-2), against the real Redis.

Anyone who can write to Redis can enqueue RQ jobs and plant RQ job hashes. Neither may
run code in ``pagestream bulk-worker``, and no log line may carry the Redis password.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import uuid

import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from pagestream.producer.bulk.api import BulkStatus, create_bulk, rescue_stalled
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.redaction import RedactingFilter, redact, redact_url
from tests.queue_helpers import ROOT


def pagestream(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagestream.worker.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})


def test_bulk_worker_refuses_jobs_naming_other_functions(redis_url, tmp_path):
    marker = tmp_path / "pwned"
    conn = redis.Redis.from_url(redis_url)
    # what an attacker with Redis access does: a plain RQ queue of the same name, JSON-serialized
    evil = Queue("pagestream-bulk", connection=conn, serializer=JSONSerializer).enqueue(
        "subprocess.check_call", ["touch", str(marker)])
    evil_callback = Queue("pagestream-bulk", connection=conn, serializer=JSONSerializer).enqueue(
        "os.getpid", on_failure="subprocess.check_call")

    out = pagestream("bulk-worker", "--redis-url", redis_url, "--burst")
    assert out.returncode == 0, out.stderr
    assert not marker.exists()
    for job in (evil, evil_callback):
        job = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
        assert job.get_status() == JobStatus.FAILED
        assert "UnsafeJobError" in job.latest_result().exc_string and "refusing to run" in job.latest_result().exc_string


class _Plant:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling this creates the file


def test_stalled_bulk_rescue_never_unpickles_rq_job_meta(redis_url, tmp_path):
    marker = tmp_path / "unpickled"
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    bulk_id = create_bulk(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), connection=conn)
    rq_job_id = f"planted-{uuid.uuid4().hex[:8]}"
    raw = redis.Redis.from_url(redis_url)
    raw.hset(f"rq:job:{rq_job_id}", mapping={"status": "finished", "meta": pickle.dumps(_Plant(str(marker))),
                                              "data": b"", "created_at": "2026-01-01T00:00:00.000000Z"})
    conn.hset(keys.bulk_hash(bulk_id), mapping={"status": BulkStatus.IN_PROGRESS.value, "rq_job_id": rq_job_id})

    assert rescue_stalled(conn) == [bulk_id]  # an unreadable job counts as gone: the bulk is re-enqueued
    assert not marker.exists()


def test_worker_logs_never_show_the_redis_password(redis_url, tmp_path):
    password = f"pw-{uuid.uuid4().hex}"
    user = f"pstest{uuid.uuid4().hex[:6]}"
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all")
    try:
        db = redis_url.rsplit("/", 1)[1]
        secret_url = f"redis://{user}:{password}@127.0.0.1:{admin.connection_pool.connection_kwargs['port']}/{db}"
        assert redis.Redis.from_url(secret_url).ping()
        out = pagestream("worker", "--redis-url", secret_url, "--model", "fake", "--burst", "--log-level", "DEBUG")
        assert out.returncode == 0, out.stderr
        logged = out.stdout + out.stderr
        assert "ready on" in logged and f"{user}:***@" in logged
        assert password not in logged
    finally:
        admin.execute_command("ACL", "DELUSER", user)


def test_redaction_masks_passwords_in_messages_and_tracebacks():
    assert redact_url("rediss://default:hunter2@redis.internal:6380/0") == "rediss://default:***@redis.internal:6380/0"
    assert redact_url("redis://:hunter2@h/1") == "redis://:***@h/1"
    assert redact_url("redis://localhost:6379/0") == "redis://localhost:6379/0"  # a port is no password
    assert redact("see s3://bucket/key and http://u:p%40ss@minio:9000/x") == "see s3://bucket/key and http://u:***@minio:9000/x"

    try:
        raise ConnectionError("cannot reach redis://app:hunter2@10.0.0.1:6379/0")
    except ConnectionError:
        record = logging.LogRecord("t", logging.ERROR, __file__, 1, "connecting to %s", ("redis://:hunter2@h",),
                                   sys.exc_info())
    RedactingFilter().filter(record)
    text = logging.Formatter().format(record)
    assert "hunter2" not in text and "redis://:***@h" in text and "redis://app:***@10.0.0.1" in text
