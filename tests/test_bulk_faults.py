"""S3 faults through a fault-injecting HTTP proxy in front of moto server (acceptance 3)."""
from __future__ import annotations

import json

import boto3
import pytest
import redis

from pagestream.producer.protocol import keys
from pagestream.producer.bulk.api import get_bulk, submit_bulk
from test_bulk import read_jsonl, rq_burst, run_bulk_with_standins, write_input
from test_bulk_support import AWS_ENV, FaultProxy, FaultRule


@pytest.fixture
def proxy(moto_url, monkeypatch):
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    p = FaultProxy(moto_url, timeout_sleep_s=2.5)
    monkeypatch.setenv("S3_ENDPOINT_URL", p.url)
    monkeypatch.setenv("S3_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("S3_CONNECT_TIMEOUT_S", "1")
    yield p
    p.close()


@pytest.fixture
def s3(moto_url):
    return boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def _keys(s3, bucket, prefix=""):
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def test_transient_faults_are_retried_and_output_is_exact(redis_url, proxy, s3, tmp_path):
    s3.create_bucket(Bucket="flaky")
    inp = tmp_path / "in.jsonl"
    expected = write_input(inp, 400, bad_every=40)
    s3.upload_file(str(inp), "flaky", "in.jsonl")
    proxy.rules = [
        # part files from the workers: 500s, a timeout before and one after the object landed
        FaultRule("PUT", r"^/flaky/out/parts/", status=500, times=3),
        FaultRule("PUT", r"^/flaky/out/parts/", status="timeout", times=1),
        FaultRule("PUT", r"^/flaky/out/parts/", status="timeout", times=1, after_forward=True),
        # shard uploads: a failed part upload, failed completions, and a completion whose response is lost
        FaultRule("PUT", r"^/flaky/out/output-", query_re="partNumber", status=503, times=1, code="SlowDown"),
        FaultRule("POST", r"^/flaky/out/output-", query_re="uploadId", status=500, times=2),
        FaultRule("POST", r"^/flaky/out/errors-", query_re="uploadId", status="timeout", times=1,
                  after_forward=True),
        FaultRule("POST", r"^/flaky/out/manifest", query_re="uploadId", status=500, times=1),
        # the input stream
        FaultRule("GET", r"^/flaky/in.jsonl", status=500, times=1),
        FaultRule("GET", r"^/flaky/in.jsonl", status="truncate", times=1, after_forward=True),
    ]
    bulk_id = submit_bulk("s3://flaky/in.jsonl", "s3://flaky/out", redis_url=redis_url, shard_lines=150,
                          max_outstanding=64)
    st = run_bulk_with_standins(redis_url, bulk_id, n_workers=2)
    assert st["status"] == "completed", st
    assert all(rule.hits for rule in proxy.rules), [(r.method, r.path_re.pattern, r.hits) for r in proxy.rules]
    assert st["request_counts"] == {"total": 400, "completed": 390, "failed": 10}
    manifest = json.loads(s3.get_object(Bucket="flaky", Key="out/manifest.json")["Body"].read())
    lines = []
    for shard in manifest["output_shards"]:
        lines += read_jsonl(s3.get_object(Bucket="flaky", Key=f"out/{shard['name']}")["Body"].read())
    assert sorted(r["custom_id"] for r in lines) == sorted(expected)  # exactly one per custom_id
    errors = read_jsonl(s3.get_object(Bucket="flaky", Key="out/errors-00000.jsonl")["Body"].read())
    assert [e["error"]["line"] for e in errors] == list(range(40, 401, 40))
    assert _keys(s3, "flaky", "out/parts/") == []
    assert s3.list_multipart_uploads(Bucket="flaky").get("Uploads", []) == []


def test_access_denied_on_output_fails_before_queueing(redis_url, proxy, s3, tmp_path):
    s3.create_bucket(Bucket="denied")
    inp = tmp_path / "in.jsonl"
    write_input(inp, 10)
    proxy.rules = [FaultRule("HEAD", r"^/denied", status=403, times=-1, code="AccessDenied")]
    bulk_id = submit_bulk(str(inp), "s3://denied/out", redis_url=redis_url)
    rq_burst(redis_url)
    st = get_bulk(redis.Redis.from_url(redis_url, decode_responses=True), bulk_id)
    assert st["status"] == "failed" and "access denied to bucket 'denied'" in st["error"], st
    assert redis.Redis.from_url(redis_url).xlen(keys.jobs_stream("low")) == 0
    assert _keys(s3, "denied") == []


def test_permanent_failure_at_finalize_leaves_nothing_half_written(redis_url, proxy, s3, tmp_path):
    s3.create_bucket(Bucket="halfway")
    inp = tmp_path / "in.jsonl"
    write_input(inp, 120)
    # shards can be started but never completed: access is denied on every completion
    proxy.rules = [FaultRule("POST", r"^/halfway/out/output-", query_re="uploadId=", status=403, times=-1,
                             code="AccessDenied")]
    bulk_id = submit_bulk(str(inp), "s3://halfway/out", redis_url=redis_url, shard_lines=50)
    st = run_bulk_with_standins(redis_url, bulk_id, n_workers=1)
    assert st["status"] == "failed", st
    assert "AccessDenied" in st["error"] and "s3://halfway/out/output-00000.jsonl" in st["error"]
    keys = _keys(s3, "halfway", "out/")
    assert not [k for k in keys if not k.startswith("out/parts/")], keys  # no shard, no manifest
    assert s3.list_multipart_uploads(Bucket="halfway").get("Uploads", []) == []


def test_workers_denied_on_parts_fail_the_bulk_with_a_clear_message(redis_url, proxy, s3, tmp_path):
    s3.create_bucket(Bucket="noparts")
    inp = tmp_path / "in.jsonl"
    write_input(inp, 30)
    proxy.rules = [FaultRule("PUT", r"^/noparts/out/parts/", status=403, times=-1, code="AccessDenied")]
    bulk_id = submit_bulk(str(inp), "s3://noparts/out", redis_url=redis_url)
    st = run_bulk_with_standins(redis_url, bulk_id, n_workers=1)
    assert st["status"] == "failed", st
    assert st["error"].startswith("workers cannot write parts to s3://noparts/out") and "AccessDenied" in st["error"]
    assert _keys(s3, "noparts") == []
