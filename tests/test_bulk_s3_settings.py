"""Bulk S3 settings travel with the bulk (issue 13, acceptance 4), with the real processes: a
``pagestream bulk-worker`` and a ``pagestream worker`` (instant fake engine) against moto server.

1. Neither process is told the S3 endpoint: the one given at ``bulk submit`` is where the workers
   write their parts and the bulk completes.
2. A worker without S3 credentials fails the bulk with that reason within a bounded time, and
   ``bulk submit --wait`` shows the sink error while it lasts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import boto3
import pytest

from test_bulk_e2e import stop_all
from test_bulk_support import AWS_ENV
from tests.queue_helpers import ROOT
from zygote import run, spawn

pytestmark = pytest.mark.slow

S3_ENV_NAMES = ("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "PAGESTREAM_S3_ENDPOINT_URL")


def _env(credentials: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in S3_ENV_NAMES and not k.startswith("AWS_")}
    env.update({"PYTHONUNBUFFERED": "1", "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent",
                "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "PAGESTREAM_BULK_FLUSH_INTERVAL_S": "0.3"})
    if credentials:
        env.update(AWS_ENV)
    return env


def _cli(*args: str, env: dict, **kw) -> subprocess.Popen:
    return spawn([sys.executable, "-m", "pagestream.worker.cli", *args], cwd=ROOT, env=env, text=True, **kw)


@pytest.fixture
def processes():
    procs: list[subprocess.Popen] = []
    yield procs
    stop_all(procs)


def _start(processes, redis_url, tmp_path, worker_credentials: bool) -> None:
    processes.append(_cli("bulk-worker", "--redis-url", redis_url, env=_env(True),
                          stdout=subprocess.DEVNULL, stderr=open(tmp_path / "bulk-worker.log", "w")))
    processes.append(_cli("worker", "--redis-url", redis_url, "--model", "fake", "--lanes", "low", "--consumer", "w3",
                          env=_env(worker_credentials), stdout=subprocess.DEVNULL,
                          stderr=open(tmp_path / "worker.log", "w")))


def _s3(moto_url: str):
    return boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def _input(s3, bucket: str, n: int) -> str:
    s3.create_bucket(Bucket=bucket)
    body = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "tiny", "prompt": f"p {i}", "max_tokens": 3}}) + "\n" for i in range(n))
    s3.put_object(Bucket=bucket, Key="in.jsonl", Body=body.encode())
    return f"s3://{bucket}/in.jsonl"


def test_endpoint_given_at_submit_is_where_workers_write(redis_url, moto_url, processes, tmp_path):
    s3 = _s3(moto_url)
    inp = _input(s3, "travel", 40)
    _start(processes, redis_url, tmp_path, worker_credentials=True)
    out = run([sys.executable, "-m", "pagestream.worker.cli", "bulk", "submit", inp, "--out", "s3://travel/out",
                          "--redis-url", redis_url, "--s3-endpoint-url", moto_url, "--s3-region", "us-east-1",
                          "--s3-addressing-style", "path", "--wait"],
                         cwd=ROOT, env=_env(True), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, (out.stdout, out.stderr[-3000:], (tmp_path / "worker.log").read_text()[-3000:])
    manifest = json.loads(s3.get_object(Bucket="travel", Key="out/manifest.json")["Body"].read())
    assert manifest["request_counts"]["completed"] == 40
    bulk_id = out.stdout.splitlines()[0]
    status = run([sys.executable, "-m", "pagestream.worker.cli", "bulk", "status", bulk_id, "--json",
                             "--redis-url", redis_url], cwd=ROOT, env=_env(True), capture_output=True, text=True)
    assert "sink_error" not in json.loads(status.stdout)


def test_worker_without_credentials_fails_the_bulk_in_bounded_time(redis_url, moto_url, processes, tmp_path):
    s3 = _s3(moto_url)
    inp = _input(s3, "nocreds", 10)
    _start(processes, redis_url, tmp_path, worker_credentials=False)
    started = time.monotonic()
    submit = _cli("bulk", "submit", inp, "--out", "s3://nocreds/out", "--redis-url", redis_url, "--s3-endpoint-url",
                  moto_url, "--wait", env={**_env(True), "COLUMNS": "400"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    processes.append(submit)
    stdout, stderr = submit.communicate(timeout=120)
    elapsed = time.monotonic() - started
    assert submit.returncode == 1, (stdout, stderr[-3000:])
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("failed:") and "workers cannot write parts to s3://nocreds/out" in last, last
    assert "Unable to locate credentials" in last
    assert "sink_error" in stderr and "Unable to locate credentials" in stderr  # the progress line showed it
    assert elapsed < 90
