"""Bulk dataset generation against a real Redis, a real RQ worker and moto server over HTTP.

The workers here are a stand-in (tests/test_bulk_support.py) that reads the bulk's
jobs off the lane stream, answers with a fake engine and feeds the real BulkSink;
tests/test_bulk_e2e.py runs the real worker processes with the tiny model.
"""
from __future__ import annotations

import json
import os
import threading
import time

import boto3
import openai
import pytest
import redis

from pagestream.producer.protocol import keys
from pagestream.producer.bulk.api import BULK_QUEUE, bulk_queue, cancel_bulk, get_bulk, submit_bulk
from pagestream.producer.bulk.io import BadLine, BulkRequest, parse_line
from pagestream.producer.bulk.s3 import S3Storage
from pagestream.producer.bulk.storage import ConflictError, LocalStorage, StorageSettings
from test_bulk_support import AWS_ENV, run_standin


@pytest.fixture
def s3(moto_url, monkeypatch):
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("S3_ENDPOINT_URL", moto_url)
    client = boto3.client("s3", endpoint_url=moto_url)
    return client


@pytest.fixture
def bucket(s3, request):
    name = "bulk-" + request.node.name.lower().replace("_", "-")[:40]
    s3.create_bucket(Bucket=name)
    return name


def rq_burst(url: str) -> None:
    from pagestream.producer.bulk.rq_queue import BulkWorker

    conn = redis.Redis.from_url(url)
    q = bulk_queue(conn)
    BulkWorker([q], connection=conn, serializer=q.serializer, job_class=q.job_class).work(burst=True)


def write_input(path, n: int, bad_every: int = 0) -> dict[str, str]:
    """n lines mixing both forms; every bad_every-th line is malformed. Returns custom_id -> prompt."""
    expected = {}
    with open(path, "w") as f:
        for i in range(1, n + 1):
            if bad_every and i % bad_every == 0:
                f.write(["{not json", '{"custom_id": "x%d", "url": "/v1/embeddings", "body": {}}' % i,
                         '{"prompt": "a", "temperature": -1}', '[1, 2]'][i // bad_every % 4] + "\n")
                continue
            cid = f"req-{i}"
            if i % 3 == 0:
                line = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": "tiny", "messages": [{"role": "user", "content": f"hello {i}"}],
                                 "max_tokens": 4}}
                expected[cid] = f"hello {i}"
            elif i % 3 == 1:
                line = {"custom_id": cid, "method": "POST", "url": "/v1/completions",
                        "body": {"model": "tiny", "prompt": f"prompt {i}", "max_tokens": 4, "temperature": 0}}
                expected[cid] = f"prompt {i}"
            else:
                line = {"custom_id": cid, "prompt": f"plain {i}", "max_tokens": 4}
                expected[cid] = f"plain {i}"
            f.write(json.dumps(line) + "\n")
    return expected


def read_jsonl(data: bytes) -> list[dict]:
    return [json.loads(x) for x in data.splitlines() if x.strip()]


# ---- parsing --------------------------------------------------------------------------------

def test_parse_line_forms_and_reasons():
    ok = parse_line(b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                    b'"body": {"prompt": "hi", "max_tokens": 3, "stop": "x"}}', 1)
    assert isinstance(ok, BulkRequest) and ok.custom_id == "a" and not ok.is_chat
    assert ok.body.sampling() == {"max_tokens": 3, "stop": ["x"]}
    plain = parse_line('{"messages": [{"role": "user", "content": "yo"}]}', 7)
    assert isinstance(plain, BulkRequest) and plain.is_chat and plain.custom_id == "line-7"
    assert parse_line(b"   ", 3) is None
    # logprobs as each endpoint spells them become the job's count of alternatives
    assert parse_line(b'{"prompt": "a", "logprobs": 2}', 1).logprobs == 2
    chat_lp = b'{"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], "logprobs": true%s}}'
    assert parse_line(chat_lp % b', "top_logprobs": 4', 1).logprobs == 4 and parse_line(chat_lp % b"", 1).logprobs == 0
    assert ok.logprobs is None and parse_line(b'{"messages": [{"role": "user", "content": "x"}], "logprobs": false}', 1).logprobs is None
    # vLLM's prompt_logprobs ride on the job (the output body carries them in vLLM's shape)
    assert parse_line(b'{"prompt": "a", "prompt_logprobs": 2}', 1).body.sampling() == {"prompt_logprobs": 2}
    cases = {
        b"{oops": "invalid JSON",
        b"[1]": "JSON object",
        b'{"custom_id": "a", "url": "/v1/embeddings", "body": {}}': "url must be one of",
        b'{"url": "/v1/completions", "body": {"prompt": "x"}}': "custom_id is required",
        b'{"custom_id": "a", "url": "/v1/completions", "body": {"messages": [{"role": "user", "content": "x"}]}}':
            "needs body.prompt",
        b'{"prompt": "a", "temperature": -1}': "temperature",
        b'{"prompt": "a", "n": 0}': "line.n: Input should be greater than or equal to 1",
        b'{"prompt": "a", "logprobs": true}': "logprobs is the number of alternatives per token",
        b'{"prompt": "a", "top_logprobs": 2}': "top_logprobs is a chat field",
        b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}': "top_logprobs needs logprobs: true",
        b'{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], '
        b'"logprobs": 3}}': "body: for chat, logprobs is true or false",
        b'{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": '
        b'[{"type": "image_url", "image_url": {"url": "x"}}]}], "logprobs": true}}': "only text content parts",
        b'{"custom_id": 5, "prompt": "a"}': "custom_id must be",
        b'\xff\xfe': "not UTF-8",
        b'{"max_tokens": 3}': "exactly one of 'prompt' or 'messages'",
    }
    for raw, reason in cases.items():
        bad = parse_line(raw, 42)
        assert isinstance(bad, BadLine) and bad.line == 42 and reason in bad.reason, (raw, bad)


def test_a_lines_logit_bias_and_allowed_token_ids_reach_its_job_or_name_the_field():
    from pagestream.producer.bulk.orchestrator import bulk_job
    from pagestream.producer.bulk.api import BulkSpec
    from pagestream.producer.protocol.schema import JobRequest

    spec = BulkSpec(bulk_id="batch_lb", input="/in.jsonl", output="/out")
    line = parse_line(b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi", '
                      b'"logit_bias": {"5": -100, "7": 2.5}, "allowed_token_ids": [5, 7, 9]}}', 1)
    job = JobRequest(**bulk_job(line, spec))
    assert job.sampling.logit_bias == {5: -100.0, 7: 2.5} and job.sampling.allowed_token_ids == [5, 7, 9]
    for body, field in ((b'"logit_bias": {"5": 300}', "logit_bias"), (b'"logit_bias": {"x": 1}', "logit_bias"),
                        (b'"allowed_token_ids": []', "allowed_token_ids")):
        bad = bulk_job(parse_line(b'{"prompt": "hi", ' + body + b"}", 3), spec)
        assert isinstance(bad, BadLine) and field in bad.reason, bad


# ---- storage --------------------------------------------------------------------------------

def test_local_storage_write_once_and_stream(tmp_path):
    st = LocalStorage(f"file://{tmp_path}/out")
    src = tmp_path / "shard"
    src.write_bytes(b"a\nbb\nccc\n")
    info = st.put_file_once("output-00000.jsonl", src)
    assert info.size_bytes == 9 and st.put_file_once("output-00000.jsonl", src).sha256 == info.sha256
    src.write_bytes(b"different\n")
    with pytest.raises(ConflictError):
        st.put_file_once("output-00000.jsonl", src)
    lines = list(st.open_lines("output-00000.jsonl"))
    assert lines == [(b"a", 2), (b"bb", 5), (b"ccc", 9)]
    assert list(st.open_lines("output-00000.jsonl", offset=5)) == [(b"ccc", 9)]


def test_s3_storage_multipart_write_once_and_ranged_stream(s3, bucket, tmp_path, moto_url):
    st = S3Storage(f"s3://{bucket}/run", StorageSettings(s3_endpoint_url=moto_url))
    src = tmp_path / "shard"
    src.write_bytes(b"x" * (9 * 1024 * 1024) + b"\nend\n")  # two multipart parts
    info = st.put_file_once("output-00000.jsonl", src)
    head = s3.head_object(Bucket=bucket, Key="run/output-00000.jsonl")
    assert head["ContentLength"] == info.size_bytes and head["Metadata"]["sha256"] == info.sha256
    assert st.put_file_once("output-00000.jsonl", src) == info  # same bytes: a no-op
    src.write_bytes(b"other\n")
    with pytest.raises(ConflictError):
        st.put_file_once("output-00000.jsonl", src)
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    lines = list(st.open_lines("output-00000.jsonl", offset=9 * 1024 * 1024 + 1))
    assert lines == [(b"end", info.size_bytes)]


# ---- end to end with the stand-in worker ----------------------------------------------------

def run_bulk_with_standins(redis_url, bulk_id, n_workers=2, **kw):
    stop = threading.Event()
    threads = [threading.Thread(target=run_standin, args=(redis_url, f"w{i}"), kwargs={"stop": stop, **kw})
               for i in range(n_workers)]
    for t in threads:
        t.start()
    try:
        rq_burst(redis_url)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    return get_bulk(redis.Redis.from_url(redis_url, decode_responses=True), bulk_id)


def test_bulk_s3_end_to_end_one_line_per_custom_id(redis_url, s3, bucket, tmp_path):
    inp = tmp_path / "in.jsonl"
    expected = write_input(inp, 300, bad_every=25)
    s3.upload_file(str(inp), bucket, "input/in.jsonl")
    bulk_id = submit_bulk(f"s3://{bucket}/input/in.jsonl", f"s3://{bucket}/out", redis_url=redis_url,
                          shard_lines=100, max_outstanding=64, model="tiny")
    st = run_bulk_with_standins(redis_url, bulk_id)
    assert st["status"] == "completed", st
    assert st["request_counts"] == {"total": 300, "completed": 288, "failed": 12}

    names = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="out/")["Contents"])
    assert names == ["out/errors-00000.jsonl", "out/manifest.json", "out/output-00000.jsonl",
                    "out/output-00001.jsonl", "out/output-00002.jsonl"]  # parts removed
    manifest = json.loads(s3.get_object(Bucket=bucket, Key="out/manifest.json")["Body"].read())
    assert manifest["request_counts"] == {"total": 300, "completed": 288, "failed": 12}
    assert [s["lines"] for s in manifest["output_shards"]] == [100, 100, 88]
    out = []
    for shard in manifest["output_shards"]:
        obj = s3.get_object(Bucket=bucket, Key=f"out/{shard['name']}")
        assert obj["ContentLength"] == shard["bytes"]
        out += read_jsonl(obj["Body"].read())
    assert sorted(r["custom_id"] for r in out) == sorted(expected)
    by_id = {r["custom_id"]: r for r in out}
    for r in out:  # every body is what the official SDK parses, with a model name (never null)
        body = r["response"]["body"]
        sdk = openai.types.chat.ChatCompletion if body["object"] == "chat.completion" else openai.types.Completion
        assert sdk.model_validate(body).model
    chat = by_id["req-3"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == "echo:" + "3 olleh"
    comp = by_id["req-1"]["response"]
    assert comp["status_code"] == 200 and comp["body"]["choices"][0]["text"] == "echo:" + "1 tpmorp"
    assert comp["body"]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    errors = read_jsonl(s3.get_object(Bucket=bucket, Key="out/errors-00000.jsonl")["Body"].read())
    assert [e["error"]["line"] for e in errors] == list(range(25, 301, 25))
    assert all(e["response"] is None and e["error"]["message"] for e in errors)
    # RQ shows it like any other job, with progress in meta
    from rq.job import Job

    job = Job.fetch(bulk_id, connection=redis.Redis.from_url(redis_url), serializer=bulk_queue(redis.Redis()).serializer)
    assert job.get_status() == "finished" and job.meta["request_counts"]["completed"] == 288
    # bookkeeping sets are gone, the status hash stays (with a TTL)
    r = redis.Redis.from_url(redis_url)
    assert not r.exists(keys.bulk_done_set(bulk_id), keys.bulk_seen_hash(bulk_id))
    assert r.ttl(keys.bulk_hash(bulk_id)) > 0
    # each job's own hash is final and expires like any result
    assert r.hget(keys.job_hash(f"{bulk_id}-L1"), "status") == b"completed"
    assert r.ttl(keys.job_hash(f"{bulk_id}-L1")) > 0


def test_bulk_local_dir_duplicates_and_engine_errors(redis_url, tmp_path):
    inp = tmp_path / "in.jsonl"
    lines = [{"custom_id": "a", "prompt": "one"}, {"custom_id": "b", "prompt": "BOOM"},
             {"custom_id": "a", "prompt": "dup"}, {"prompt": "auto id"}]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n")
    out = tmp_path / "out"
    bulk_id = submit_bulk(str(inp), str(out), redis_url=redis_url)
    st = run_bulk_with_standins(redis_url, bulk_id, n_workers=1, fail_prompt="BOOM")
    assert st["status"] == "completed" and st["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert sorted(p.name for p in out.iterdir()) == ["errors-00000.jsonl", "manifest.json", "output-00000.jsonl"]
    ok = read_jsonl((out / "output-00000.jsonl").read_bytes())
    assert [r["custom_id"] for r in ok] == ["a", "line-4"]
    errs = read_jsonl((out / "errors-00000.jsonl").read_bytes())
    assert [(e["custom_id"], e["error"]["line"]) for e in errs] == [("b", 2), ("a", 3)]
    assert errs[0]["error"]["message"] == "engine exploded"
    assert "duplicate custom_id (first used on line 1)" in errs[1]["error"]["message"]


def test_missing_bucket_fails_fast_with_clear_message(redis_url, s3, bucket, tmp_path):
    inp = tmp_path / "in.jsonl"
    write_input(inp, 5)
    bulk_id = submit_bulk(str(inp), "s3://no-such-bucket-here/out", redis_url=redis_url)
    rq_burst(redis_url)
    st = get_bulk(redis.Redis.from_url(redis_url, decode_responses=True), bulk_id)
    assert st["status"] == "failed"
    assert "s3://no-such-bucket-here" in st["error"] and "NoSuchBucket" in st["error"]
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    assert r.xlen(keys.jobs_stream("low")) == 0  # nothing was queued


def test_cancel_finalizes_what_is_done(redis_url, tmp_path):
    inp = tmp_path / "in.jsonl"
    write_input(inp, 200)
    out = tmp_path / "out"
    bulk_id = submit_bulk(str(inp), str(out), redis_url=redis_url, max_outstanding=16)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    cancel_bulk(r, bulk_id)  # before anything ran: nothing is fed
    st = run_bulk_with_standins(redis_url, bulk_id, n_workers=1)
    assert st["status"] == "cancelled"
    manifest = json.loads((out / "manifest.json").read_text())
    # every line is accounted for: none ran, so each is an error line with code "cancelled" (issue 22)
    assert manifest["status"] == "cancelled" and manifest["request_counts"] == {"total": 200, "completed": 0, "failed": 200}
    errors = read_jsonl((out / "errors-00000.jsonl").read_bytes())
    assert len(errors) == 200 and {e["error"]["code"] for e in errors} == {"cancelled"}


def test_expired_bulk_finalizes_what_is_done(redis_url, tmp_path):
    inp = tmp_path / "in.jsonl"
    write_input(inp, 50)
    out = tmp_path / "out"
    bulk_id = submit_bulk(str(inp), str(out), redis_url=redis_url, completion_window_s=0.01)
    rq_burst(redis_url)  # no workers at all: nothing completes inside the window
    st = get_bulk(redis.Redis.from_url(redis_url, decode_responses=True), bulk_id)
    assert st["status"] == "expired" and st["request_counts"]["completed"] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "expired" and (out / "output-00000.jsonl").read_bytes() == b""
    # every line is accounted for: an error line with code "expired" each (issue 22)
    assert manifest["request_counts"] == {"total": 50, "completed": 0, "failed": 50}
    errors = read_jsonl((out / "errors-00000.jsonl").read_bytes())
    assert len(errors) == 50 and {e["error"]["code"] for e in errors} == {"expired"}


def test_cli_submit_wait_status_cancel_with_plain_rq_worker(redis_url, tmp_path):
    """``pagestream bulk submit --wait`` while a plain ``rq worker`` runs the orchestrator."""
    import subprocess
    import sys
    from pathlib import Path

    from typer.testing import CliRunner

    from pagestream.worker.cli import app

    inp = tmp_path / "in.jsonl"
    expected = write_input(inp, 120, bad_every=30)
    out = tmp_path / "out"
    stop = threading.Event()
    standin = threading.Thread(target=run_standin, args=(redis_url, "cli-w"), kwargs={"stop": stop})
    standin.start()
    rq_exe = str(Path(sys.executable).with_name("rq"))
    rq_proc = subprocess.Popen([rq_exe, "worker", BULK_QUEUE, "--url", redis_url, "--burst", "-S",
                                "rq.serializers.JSONSerializer", "--job-class", "pagestream.producer.bulk.rq_queue.BulkJob"], env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        runner = CliRunner()
        res = runner.invoke(app, ["bulk", "submit", str(inp), "--out", f"file://{out}", "--redis-url", redis_url,
                                  "--shard-lines", "50", "--wait"])
        assert res.exit_code == 0, res.output
        bulk_id = res.output.splitlines()[0].strip()
        assert "completed: 116 completed, 4 failed" in res.output
    finally:
        stop.set()
        standin.join(timeout=30)
        try:
            rq_proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            # RQ 3.0's own burst worker can sit 60 s in its exit once its work is done (it sends UNSUBSCRIBE before
            # it clears its listener's run flag: BENCHMARKS.md, "Test time"; our BulkWorker does not): stop it warm
            rq_proc.terminate()
            rq_proc.wait(timeout=30)
    res = runner.invoke(app, ["bulk", "status", bulk_id, "--redis-url", redis_url, "--json"])
    st = json.loads(res.output)
    assert st["status"] == "completed" and st["request_counts"] == {"total": 120, "completed": 116, "failed": 4}
    batch = openai.types.Batch.model_validate(st)  # what an OpenAI client expects of a batch
    assert batch.created_at == int(st["created_at"]) and batch.endpoint in ("/v1/chat/completions", "/v1/completions")
    assert batch.output_file_id == f"file-{bulk_id}-output" and batch.error_file_id == f"file-{bulk_id}-errors"
    # the dataset is readable by the group that consumes it: created per the umask, not 0600
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o666 & ~umask}
    assert sorted(p.name for p in out.iterdir()) == ["errors-00000.jsonl", "manifest.json", "output-00000.jsonl",
                                                     "output-00001.jsonl", "output-00002.jsonl"]
    assert len(expected) == 116
    res = runner.invoke(app, ["bulk", "status", bulk_id, "--redis-url", redis_url])
    assert res.exit_code == 0 and "completed" in res.output and "total=120" in res.output
    assert runner.invoke(app, ["bulk", "cancel", bulk_id, "--redis-url", redis_url]).output.strip() == "completed"
    assert runner.invoke(app, ["bulk", "status", "nope", "--redis-url", redis_url]).exit_code == 2


def test_backend_enqueues_the_documented_function_itself(redis_url, tmp_path):
    from pagestream.producer.bulk.api import RUN_BULK_FUNC, create_bulk

    inp = tmp_path / "in.jsonl"
    expected = write_input(inp, 40)
    out = tmp_path / "out"
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    bulk_id = create_bulk(str(inp), str(out), connection=r)
    bulk_queue(redis.Redis.from_url(redis_url)).enqueue(RUN_BULK_FUNC, bulk_id, job_timeout=-1)
    st = run_bulk_with_standins(redis_url, bulk_id, n_workers=1)
    assert st["status"] == "completed" and st["request_counts"]["completed"] == len(expected) == 40
    with pytest.raises(ValueError, match="already exists"):
        create_bulk(str(inp), str(out), connection=r, bulk_id=bulk_id)


def test_finalize_rerun_after_crash_mid_upload_is_idempotent(s3, bucket, moto_url):
    """A finalize that died after some shards were written re-runs to the same bytes (write-once shards)."""
    from pagestream.producer.bulk.finalize import compact
    from pagestream.producer.bulk.parts import PartEntry

    st = S3Storage(f"s3://{bucket}/out", StorageSettings(s3_endpoint_url=moto_url))
    entries = [PartEntry(line=i, custom_id=f"c{i}", ok=i % 7 != 0, record={"custom_id": f"c{i}", "n": i})
               for i in range(1, 101)]
    # two parts, one duplicate line (a re-run job) in the second
    st.put_bytes("parts/w0-000001.jsonl", b"".join(e.dumps() for e in entries[:60]))
    st.put_bytes("parts/w1-000002.jsonl", b"".join(e.dumps() for e in entries[55:]))
    parts = ["parts/w0-000001.jsonl", "parts/w1-000002.jsonl"]

    class Crash(Exception):
        pass

    real = st.put_file_once
    calls = []

    def crash_after_two(name, src):
        calls.append(name)
        if len(calls) > 2:
            raise Crash(name)
        return real(name, src)

    st.put_file_once = crash_after_two
    with pytest.raises(Crash):
        compact(st, parts, bulk_id="b", shard_lines=30, header={})
    st.put_file_once = real
    manifest = compact(st, parts, bulk_id="b", shard_lines=30, header={})
    assert manifest["request_counts"] == {"total": 100, "completed": 86, "failed": 14}
    assert [s["lines"] for s in manifest["output_shards"]] == [30, 30, 26]
    got = []
    for shard in manifest["output_shards"]:
        got += read_jsonl(s3.get_object(Bucket=bucket, Key=f"out/{shard['name']}")["Body"].read())
    assert [r["n"] for r in got] == [i for i in range(1, 101) if i % 7]
    assert compact(st, parts, bulk_id="b", shard_lines=30, header={}) == manifest  # manifest exists: no-op


def test_sink_acks_only_durable_entries_and_drops_final_bulks(redis_url, tmp_path):
    from pagestream.producer.bulk.api import create_bulk
    from pagestream.producer.protocol.schema import JobRequest, JobResult, JobStatus, OutputTarget
    from pagestream.worker.bulk_sink import BulkSink

    class Settings:
        bulk_flush_lines = 3
        bulk_flush_interval_s = 3600.0
        s3_endpoint_url = None

    r = redis.Redis.from_url(redis_url)  # bytes responses, like the worker's client
    out = tmp_path / "out"
    bulk_id = create_bulk(str(tmp_path / "in.jsonl"), str(out), connection=redis.Redis.from_url(redis_url, decode_responses=True))
    r.hset(keys.bulk_hash(bulk_id), "status", "in_progress")
    sink = BulkSink(r, "host/1", Settings())

    def add(i, custom_id=None):
        job = JobRequest(job_id=f"{bulk_id}-L{i}", prompt="p", lane="low", metadata={"bulk_line": i},
                         output=OutputTarget(kind="bulk", bulk_id=bulk_id, custom_id=custom_id or f"c{i}", uri=str(out)))
        sink.add("low", f"{i}-0", job, JobResult(job_id=job.job_id, status=JobStatus.COMPLETED, text=f"t{i}"))

    add(1), add(2)
    assert sink.poll() == [] and not (out / "parts").exists()  # under flush_lines, before the interval
    add(3)
    assert sink.poll() == [("low", "1-0"), ("low", "2-0"), ("low", "3-0")]
    assert [p.name for p in (out / "parts").iterdir()] == ["host_1-000001.jsonl"]
    add(3)  # the same job again (re-delivered): written, acked, not counted twice
    assert sink.close() == [("low", "3-0")]
    assert r.hget(keys.bulk_hash(bulk_id), "completed") == b"3"
    r.hset(keys.bulk_hash(bulk_id), "status", "cancelled")
    add(4)
    assert sink.close() == [("low", "4-0")] and len(list((out / "parts").iterdir())) == 2  # dropped, not written


def test_missing_input_fails_with_its_path(redis_url, tmp_path):
    bulk_id = submit_bulk(str(tmp_path / "nope.jsonl"), str(tmp_path / "out"), redis_url=redis_url)
    rq_burst(redis_url)
    st = get_bulk(redis.Redis.from_url(redis_url, decode_responses=True), bulk_id)
    assert st["status"] == "failed" and f"input file {tmp_path / 'nope.jsonl'} does not exist" in st["error"]


def test_missing_s3_input_fails_with_its_uri(redis_url, s3, bucket, tmp_path):
    bulk_id = submit_bulk(f"s3://{bucket}/nope.jsonl", str(tmp_path / "out"), redis_url=redis_url)
    rq_burst(redis_url)
    st = get_bulk(redis.Redis.from_url(redis_url, decode_responses=True), bulk_id)
    assert st["status"] == "failed" and f"s3://{bucket}/nope.jsonl does not exist" in st["error"], st


def test_cancel_mid_run_keeps_finished_lines_exactly_once(redis_url, tmp_path, monkeypatch):
    import pagestream.producer.bulk.orchestrator as orch

    monkeypatch.setattr(orch, "CANCEL_GRACE_S", 5.0)
    inp = tmp_path / "in.jsonl"
    write_input(inp, 2000)
    out = tmp_path / "out"
    bulk_id = submit_bulk(str(inp), str(out), redis_url=redis_url, max_outstanding=64)
    r = redis.Redis.from_url(redis_url, decode_responses=True)

    def cancel_when_started():
        while int(r.hget(keys.bulk_hash(bulk_id), "completed") or 0) < 100:
            time.sleep(0.05)
        cancel_bulk(r, bulk_id)

    canceller = threading.Thread(target=cancel_when_started)
    canceller.start()
    st = run_bulk_with_standins(redis_url, bulk_id, n_workers=1, delay_s=0.02)
    canceller.join()
    assert st["status"] == "cancelled", st
    manifest = json.loads((out / "manifest.json").read_text())
    n = manifest["request_counts"]["completed"]
    assert manifest["status"] == "cancelled" and 100 <= n < 2000
    lines = read_jsonl((out / "output-00000.jsonl").read_bytes())
    ids = [x["custom_id"] for x in lines]
    assert len(ids) == len(set(ids)) == n


def test_cancel_with_real_worker_skips_queued_jobs_and_finalizes_without_waiting_out_the_grace(redis_url, tmp_path, monkeypatch):
    import pagestream.producer.bulk.orchestrator as orch
    from tests.queue_helpers import wait_for
    from pagestream.worker.fake_engine import FakeConfig, FakeEngine
    from pagestream.worker.settings import WorkerSettings
    from pagestream.worker.worker import Worker

    monkeypatch.setattr(orch, "CANCEL_GRACE_S", 120.0)
    inp = tmp_path / "in.jsonl"
    write_input(inp, 60)
    out = tmp_path / "out"
    bulk_id = submit_bulk(str(inp), str(out), redis_url=redis_url, max_outstanding=100)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    engine = FakeEngine(FakeConfig(max_num_seqs=4))
    w = Worker(redis.Redis.from_url(redis_url), engine, WorkerSettings(redis_url=redis_url, consumer="w1", lanes="low"))

    def cancel_then_work():
        # every line is queued before any worker runs; then the bulk is cancelled
        wait_for(lambda: r.hget(keys.bulk_hash(bulk_id), "input_done") == "1", 60, "the input to be fed")
        cancel_bulk(r, bulk_id)
        w.run()

    t = threading.Thread(target=cancel_then_work)
    t.start()
    t0 = time.monotonic()
    try:
        rq_burst(redis_url)  # the orchestrator: feeds, sees the cancel, drains, finalizes
    finally:
        w.request_stop(cold=True)
        t.join(30)
    assert time.monotonic() - t0 < 60  # well inside the 120 s cancel grace
    st = get_bulk(r, bulk_id)
    assert st["status"] == "cancelled" and st["request_counts"]["completed"] == 0, st
    assert engine.stats().num_generated_tokens == 0  # no engine time spent on the cancelled bulk
    assert r.hget(keys.bulk_hash(bulk_id), "skipped") == "60"
    assert r.xpending(keys.jobs_stream("low"), keys.DEFAULT_GROUP)["pending"] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "cancelled"


def test_finalize_cleanup_removes_what_a_part_writer_killed_mid_write_left(tmp_path):
    """kill -9 between a part's temp file and its rename leaves ``parts/.tmp-*``; after the
    manifest, the output directory holds no ``parts/`` at all."""
    from pagestream.producer.bulk.finalize import remove_parts

    out = LocalStorage(str(tmp_path / "out"))
    out.put_bytes("parts/w0-000001.jsonl", b"{}\n")
    (tmp_path / "out" / "parts" / ".tmp-0123456789abcdef").write_bytes(b"half a li")
    assert remove_parts(out) == 1
    assert not (tmp_path / "out" / "parts").exists()


# ---- issue 37, item 6: a bad line says which line it is and what replaces a removed field ----------------

def test_a_line_nested_too_deep_still_names_its_top_level_custom_id():
    deep = {"custom_id": "deep-1", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "x", "metadata": json.loads("[" * 40 + "]" * 40)}}
    bad = parse_line(json.dumps(deep), 7)
    assert isinstance(bad, BadLine) and "invalid JSON" in bad.reason
    assert (bad.line, bad.custom_id) == (7, "deep-1")
    # nested past the standard parser's own bound too: no custom_id can be read, and nothing raises
    bad = parse_line('{"custom_id": "x", "a": ' + "[" * 200_000 + "]" * 200_000 + "}", 8, max_bytes=10**6)
    assert isinstance(bad, BadLine) and bad.custom_id in (None, "x")


@pytest.mark.parametrize("form", ["openai", "flat"])
def test_removed_guided_fields_in_a_line_name_their_replacement_as_the_gateway_does(form):
    body = {"model": "m", "prompt": "x", "guided_json": {"type": "object"}}
    line = {"custom_id": "g1", "method": "POST", "url": "/v1/completions", "body": body} if form == "openai" \
        else {"custom_id": "g1", **body}
    bad = parse_line(json.dumps(line), 1)
    assert isinstance(bad, BadLine) and bad.custom_id == "g1", bad
    assert "guided_json was removed (as in vLLM); use structured_outputs.json" in bad.reason


def test_a_bulk_worker_exits_at_once_when_its_command_listener_reads_the_unsubscribe_first(redis_url):
    """RQ 3.0 stops its command listener by sending UNSUBSCRIBE, then clearing the thread's run flag. On a busy
    machine the listener can read the reply in between and go back to wait 60 s for a subscription, and the
    worker's exit (a ``--burst`` run's too) waited that minute out. The pause below is that busy machine: the
    worker's thread descheduled right after sending UNSUBSCRIBE."""
    from pagestream.producer.bulk.rq_queue import BulkWorker

    conn = redis.Redis.from_url(redis_url)
    q = bulk_queue(conn)
    worker = BulkWorker([q], connection=conn, serializer=q.serializer, job_class=q.job_class)
    worker.subscribe()
    time.sleep(0.2)  # the listener is blocked reading its subscription
    send = worker.pubsub.unsubscribe

    def send_then_lose_the_cpu(*args, **kwargs):
        out = send(*args, **kwargs)
        time.sleep(0.5)
        return out

    worker.pubsub.unsubscribe = send_then_lose_the_cpu
    t0 = time.monotonic()
    worker.unsubscribe()
    assert time.monotonic() - t0 < 5, "the worker's exit waited out its command listener"
    assert not worker.pubsub_thread.is_alive()
