"""Bulk acceptance with the real processes: ``pagestream worker`` x2, ``pagestream bulk-worker``,
a real Redis and moto server over HTTP.

1. 1,000 lines (20 malformed) through 2 CPU workers with the tiny model: exactly 980
   output lines, one per valid custom_id, greedy bodies equal to ``LLM.generate`` /
   ``LLM.chat``; the 20 in the error shard with line numbers and reasons.
2. kill -9 of a worker (after it flushed a part) and of the bulk worker running the
   orchestrator, mid-run; restarted, the bulk completes with one line per custom_id.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from pagestream.producer.protocol import keys
from pagestream.producer.bulk.api import get_bulk, submit_bulk
from pagestream.producer.protocol.redis_conn import connect
from tests.queue_helpers import lane_group
from test_bulk import read_jsonl
from test_bulk_support import AWS_ENV
from zygote import spawn

pytestmark = [pytest.mark.slow, pytest.mark.also_on_cluster]

ROOT = Path(__file__).resolve().parent.parent
PAGESTREAM = str(Path(sys.executable).with_name("pagestream"))


def _env(moto_url: str) -> dict:
    return {**os.environ, **AWS_ENV, "S3_ENDPOINT_URL": moto_url, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PAGESTREAM_BULK_FLUSH_LINES": "64", "PAGESTREAM_BULK_FLUSH_INTERVAL_S": "0.5",
            "PAGESTREAM_BULK_LEASE_S": "3"}


def spawn_worker(redis_url, model, consumer, env, extra=()):
    return spawn([PAGESTREAM, "worker", "--redis-url", redis_url, "--model", model, "--lanes", "low",
                             "--consumer", consumer, "--lease-ms", "3000", "--log-level", "WARNING", *extra],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def spawn_bulk_worker(redis_url, env):
    return spawn([PAGESTREAM, "bulk-worker", "--redis-url", redis_url, "--rescue-interval-s", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_all(procs):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def wait_final(r, bulk_id, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = get_bulk(r, bulk_id)
        if st["status"] in ("completed", "failed", "cancelled", "expired"):
            return st
        time.sleep(0.5)
    raise TimeoutError(f"bulk {bulk_id} not final after {timeout}s: {get_bulk(r, bulk_id)}")


def read_s3_output(s3, bucket, prefix):
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/manifest.json")["Body"].read())
    out, err = [], []
    for shard in manifest["output_shards"]:
        out += read_jsonl(s3.get_object(Bucket=bucket, Key=f"{prefix}/{shard['name']}")["Body"].read())
    for shard in manifest["error_shards"]:
        err += read_jsonl(s3.get_object(Bucket=bucket, Key=f"{prefix}/{shard['name']}")["Body"].read())
    return manifest, out, err


MALFORMED = [
    "{not json at all",
    '{"custom_id": "m", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}',
    '{"prompt": "x", "temperature": -0.5}',
    '"just a string"',
    '{"custom_id": "m2", "url": "/v1/chat/completions", "body": {"messages": "hi"}}',
]


def write_acceptance_input(path: Path, n: int = 1000, n_bad: int = 20):
    """n lines, n_bad malformed (evenly spread); returns {custom_id: (kind, payload)} and bad line numbers."""
    bad_lines = set(range(n // n_bad, n + 1, n // n_bad))
    assert len(bad_lines) == n_bad
    valid = {}
    with open(path, "w") as f:
        for i in range(1, n + 1):
            if i in bad_lines:
                f.write(MALFORMED[i % len(MALFORMED)] + "\n")
                continue
            cid = f"q{i:04d}"
            if i % 4 == 0:
                msgs = [{"role": "user", "content": f"Tell me about item {i}."}]
                f.write(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "tiny", "messages": msgs, "max_tokens": 3,
                                             "temperature": 0}}) + "\n")
                valid[cid] = ("chat", msgs)
            elif i % 4 == 1:
                f.write(json.dumps({"custom_id": cid, "prompt": f"Item {i} is", "max_tokens": 3,
                                    "temperature": 0}) + "\n")
                valid[cid] = ("completion", f"Item {i} is")
            else:
                f.write(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "tiny", "prompt": f"The number {i} means",
                                             "max_tokens": 3, "temperature": 0}}) + "\n")
                valid[cid] = ("completion", f"The number {i} means")
    return valid, sorted(bad_lines)


def test_acceptance_1000_lines_two_cpu_workers_tiny_model(redis_url, moto_url, tiny_llama_dir, tmp_path):
    env = _env(moto_url)
    s3 = boto3.client("s3", endpoint_url=moto_url, **{"region_name": "us-east-1"},
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket="acc1")
    inp = tmp_path / "in.jsonl"
    valid, bad_lines = write_acceptance_input(inp)
    s3.upload_file(str(inp), "acc1", "in/requests.jsonl")
    r = connect(redis_url, decode_responses=True)
    procs = [spawn_worker(redis_url, tiny_llama_dir, f"acc-w{i}", env, ("--max-num-seqs", "32")) for i in range(2)]
    procs.append(spawn_bulk_worker(redis_url, env))
    try:
        bulk_id = submit_bulk("s3://acc1/in/requests.jsonl", "s3://acc1/out", redis_url=redis_url,
                              shard_lines=400, max_outstanding=256, s3_endpoint_url=moto_url)
        st = wait_final(r, bulk_id, 900)
    finally:
        stop_all(procs)
    assert st["status"] == "completed", st
    manifest, out, err = read_s3_output(s3, "acc1", "out")
    assert manifest["request_counts"] == {"total": 1000, "completed": 980, "failed": 20}
    assert st["request_counts"] == manifest["request_counts"]
    assert [s["lines"] for s in manifest["output_shards"]] == [400, 400, 180]
    assert len(out) == 980 and sorted(x["custom_id"] for x in out) == sorted(valid)
    assert [e["error"]["line"] for e in err] == bad_lines
    assert all(e["error"]["code"] == "invalid_request" and e["error"]["message"] for e in err)
    names = [o["Key"] for o in s3.list_objects_v2(Bucket="acc1", Prefix="out/")["Contents"]]
    assert not [k for k in names if "/parts/" in k]

    # greedy bodies equal LLM.generate / LLM.chat for the same requests
    from pagestream.engine import LLM, SamplingParams

    llm = LLM(model=tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=3)
    comp_ids = [c for c, (kind, _) in valid.items() if kind == "completion"]
    chat_ids = [c for c, (kind, _) in valid.items() if kind == "chat"]
    ref = {}
    for cid, o in zip(comp_ids, llm.generate([valid[c][1] for c in comp_ids], params, use_tqdm=False)):
        ref[cid] = o.outputs[0].text
    for cid, o in zip(chat_ids, llm.chat([valid[c][1] for c in chat_ids], params, use_tqdm=False)):
        ref[cid] = o.outputs[0].text
    got = {}
    for x in out:
        body = x["response"]["body"]
        choice = body["choices"][0]
        got[x["custom_id"]] = choice["message"]["content"] if body["object"] == "chat.completion" else choice["text"]
        assert x["response"]["status_code"] == 200 and body["usage"]["completion_tokens"] <= 3
    mismatched = [c for c in ref if ref[c] != got[c]]
    assert not mismatched, [(c, ref[c], got[c]) for c in mismatched[:5]]


def test_acceptance_kill9_worker_and_orchestrator_real_workers(redis_url, moto_url, tmp_path):
    env = _env(moto_url)
    s3 = boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket="acc2")
    inp = tmp_path / "in.jsonl"
    valid, bad_lines = write_acceptance_input(inp, n=4000, n_bad=40)
    s3.upload_file(str(inp), "acc2", "in.jsonl")  # the resumed orchestrator reads on with a ranged GET
    r = connect(redis_url, decode_responses=True)
    # fake:10 = the fake engine with a 10 ms step, so the run is long enough to kill mid-way (the kill comes once
    # worker 0 flushed its first part; the feed is still held back by max_outstanding)
    procs = {f"w{i}": spawn_worker(redis_url, "fake:10", f"acc2-w{i}", env) for i in range(2)}
    procs["orch"] = spawn_bulk_worker(redis_url, env)
    try:
        bulk_id = submit_bulk("s3://acc2/in.jsonl", "s3://acc2/out", redis_url=redis_url, shard_lines=1500,
                              max_outstanding=300, s3_endpoint_url=moto_url)
        key = keys.bulk_hash(bulk_id)
        deadline = time.time() + 120

        def w0_flushed():
            objs = s3.list_objects_v2(Bucket="acc2", Prefix="out/parts/acc2-w0-").get("Contents", [])
            return bool(objs) and int(r.hget(key, "line") or 0) > 0

        while not w0_flushed():
            assert time.time() < deadline, "worker 0 never flushed a part"
            time.sleep(0.1)
        assert r.hget(key, "input_done") is None, "input already fully fed: kill came too late"
        for name in ("w0", "orch"):
            procs[name].send_signal(signal.SIGKILL)
            procs[name].wait()
        assert lane_group(connect(redis_url), "low")["pending"] > 0
        procs["w2"] = spawn_worker(redis_url, "fake:10", "acc2-w2", env)
        procs["orch2"] = spawn_bulk_worker(redis_url, env)
        st = wait_final(r, bulk_id, 300)
    finally:
        stop_all(list(procs.values()))
    assert st["status"] == "completed", st
    assert int(r.hget(keys.bulk_hash(bulk_id), "restarts")) >= 1
    manifest, out, err = read_s3_output(s3, "acc2", "out")
    assert manifest["request_counts"] == {"total": 4000, "completed": 3960, "failed": 40}
    ids = [x["custom_id"] for x in out]
    assert len(ids) == len(set(ids)) == 3960 and set(ids) == set(valid)
    assert [e["error"]["line"] for e in err] == bad_lines
