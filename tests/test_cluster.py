"""What is particular to Redis Cluster (the shared e2e tests run there too: ``also_on_cluster``).

A real 3-master cluster (``redis_cluster`` fixture). Each test here breaks if the cluster layout
stops doing its part: detection from any node, lanes spread over every master, a submit that is
three one-slot steps staying exactly-once through a crash between them, the bulk queue refusing
to run on the cluster instead of failing obscurely.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import redis
from redis.cluster import RedisCluster

from pagestream.producer import JobStatus, Producer
from pagestream.producer.protocol import keys
from pagestream.producer.client.core import queued_key_ttl_s
from pagestream.producer.protocol.job import RESERVE_LUA
from pagestream.producer.protocol.redis_conn import connect
from pagestream.producer.protocol.schema import JobRequest
from pagestream.producer.protocol.wire import JOB_FIELD, job_fields
from pagestream.worker.fake_engine import FakeConfig, FakeEngine
from pagestream.worker.settings import WorkerSettings
from pagestream.worker.stats import collect_stats
from pagestream.worker.worker import Worker
from tests.queue_helpers import ROOT, lane_group, lane_streams


@pytest.fixture
def cluster(redis_cluster, monkeypatch):
    redis_cluster.flush()
    monkeypatch.delenv("PAGESTREAM_RQ_REDIS_URL", raising=False)
    yield redis_cluster
    redis_cluster.flush()


def _worker(url: str, consumer: str = "cw") -> Worker:
    settings = WorkerSettings(redis_url=url, consumer=consumer, publish_interval_ms=2, max_num_seqs=8)
    return Worker(connect(url), FakeEngine(FakeConfig(max_num_seqs=8, max_model_len=512)), settings)


def test_any_node_url_gives_a_cluster_client_and_a_single_node_stays_plain(cluster, redis_url):
    for port in cluster.ports:
        assert isinstance(connect(f"redis://127.0.0.1:{port}/0"), RedisCluster)
    single = connect(redis_url)
    assert type(single) is redis.Redis
    assert Producer.from_url(redis_url).layout().num_shards == 1


def test_lanes_spread_over_every_master_and_jobs_over_the_shards(cluster):
    p = Producer.from_url(cluster.url)
    layout = p.layout()
    assert layout.num_shards == 8
    p.submit_many([{"prompt": f"spread {i}", "max_tokens": 2} for i in range(400)])
    r = connect(cluster.url)
    streams = lane_streams(r, "normal")
    lengths = [r.xlen(s) for s in streams]
    assert sum(lengths) == 400 and min(lengths) > 20, lengths  # crc32 of the ids spreads them
    owners = {r.get_node_from_key(s).name for s in streams}
    assert len(owners) == 3, owners


def test_submit_is_idempotent_across_shards(cluster):
    p = Producer.from_url(cluster.url)
    assert p.submit(prompt="first", job_id="same") == "same"
    assert p.submit(prompt="second", job_id="same") == "same"
    p.submit_many([{"prompt": "third", "job_id": "same"}, {"prompt": "other", "job_id": "other"}])
    r = connect(cluster.url)
    entries = [e for s in lane_streams(r, "normal") for e in r.xrange(s)]
    assert len(entries) == 2
    assert sorted(JobRequest.model_validate_json(f[JOB_FIELD.encode()]).prompt for _, f in entries) == ["first", "other"]


def test_a_submit_retried_after_a_crash_between_its_steps_runs_the_job_once(cluster):
    """A first attempt that died after its XADD (before naming the entry in the job hash) left an
    entry; the retry queues a second one. Exactly one runs; the other is acked unrun."""
    p = Producer.from_url(cluster.url)
    r = connect(cluster.url)
    layout = p.layout()
    job = JobRequest(prompt="crashy", job_id="crash-1", max_tokens=5, seed=3)
    # attempt 1: RESERVE and XADD, then the process dies
    r.eval(RESERVE_LUA, 1, keys.job_hash(job.job_id), job.lane.value, repr(job.created_at), job.result_ttl_s, queued_key_ttl_s(job))
    stream = layout.stream(keys.lane_key("normal", layout.shard_of(job.job_id)))
    r.xadd(stream, {JOB_FIELD: job_fields(job)[JOB_FIELD]})
    # a job whose first attempt died between RESERVE and XADD
    half = JobRequest(prompt="half", job_id="crash-2", max_tokens=4, seed=4)
    r.eval(RESERVE_LUA, 1, keys.job_hash(half.job_id), half.lane.value, repr(half.created_at), half.result_ttl_s, queued_key_ttl_s(half))
    assert p.status("crash-2") == JobStatus.QUEUED
    # the callers retry
    assert p.submit(job) == "crash-1" and p.submit(half) == "crash-2"
    assert sum(r.xlen(s) for s in lane_streams(r, "normal")) == 3
    w = _worker(cluster.url)
    fake = w.engine
    added: list[str] = []
    real_add = fake.add_request
    fake.add_request = lambda rid, *a, **kw: (added.append(rid), real_add(rid, *a, **kw))[1]
    w.run(burst=True)
    res = p.result("crash-1", timeout=5)
    assert res.status == JobStatus.COMPLETED and res.deliveries == 1
    assert res.text == fake.expected_text("crashy", seed=3, max_tokens=5)
    assert p.result("crash-2", timeout=5).status == JobStatus.COMPLETED
    events = [f for _, f in r.xrange(keys.out_stream("crash-1"))]
    assert sum(1 for f in events if f.get(b"type") == b"end") == 1  # it ran once: one end entry
    # the firehose (its own hash slot, written in the same flushes): one start, one first token, one end, in order
    fired = [f[b"type"] for _, f in r.xrange(keys.events_stream()) if f.get(b"job") == b"crash-1"]
    assert [t for t in fired if t != b"queued"] == [b"started", b"first_token", b"finished"], fired
    assert sorted(added) == ["crash-1", "crash-2"]  # the stray entry never reached the engine
    assert lane_group(r, "normal")["pending"] == 0


def test_cancel_of_a_running_job_reaches_the_worker_through_the_cancel_stream(cluster):
    p = Producer.from_url(cluster.url)
    jid = p.submit(prompt="long", max_tokens=400, seed=1)
    w = _worker(cluster.url)
    w.run(max_steps=3)
    assert w.engine.stats().num_running == 1
    assert w.publisher.flush(10)  # the start marker is the publisher thread's to write, off the step
    assert p.cancel(jid) == JobStatus.RUNNING
    r = connect(cluster.url)
    assert r.xlen(keys.cancel_stream()) == 1 and r.hget(keys.job_hash(jid), "cancel_requested")
    from tests.queue_helpers import wait_for

    wait_for(lambda: w._cancel_requests, 5, "the cancel to reach the worker")
    w.run(burst=True)  # acts on the cancel, then nothing is left to do
    res = p.result(jid, timeout=5)
    assert res.status == JobStatus.CANCELLED and 0 < len(res.token_ids) < 400


def test_stats_sum_a_lanes_shards(cluster):
    p = Producer.from_url(cluster.url)
    p.submit_many([{"prompt": f"s {i}", "max_tokens": 2} for i in range(50)])
    p.submit_many([{"prompt": f"h {i}", "max_tokens": 2, "lane": "high"} for i in range(7)])
    data = collect_stats(connect(cluster.url))
    assert data["lanes"]["normal"]["length"] == 50 and data["lanes"]["high"]["length"] == 7


def test_the_bulk_queue_refuses_a_cluster_without_a_single_node_for_rq(cluster, tmp_path):
    from pagestream.producer.bulk.api import submit_bulk
    from pagestream.producer.bulk.rq_queue import RQNeedsSingleNode

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "prompt": "x"}\n')
    with pytest.raises(RQNeedsSingleNode, match="PAGESTREAM_RQ_REDIS_URL"):
        submit_bulk(str(inp), str(tmp_path / "out"), redis_url=cluster.url)
    cli = [sys.executable, "-m", "pagestream.worker.cli", "bulk-worker", "--redis-url", cluster.url, "--burst"]
    proc = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--rq-redis-url" in proc.stderr and "Traceback" not in proc.stderr


def test_the_gateway_serves_completions_and_streams_from_a_cluster(cluster, tmp_path):
    import openai

    from tests.gateway_helpers import GatewayProc
    from tests.queue_helpers import WorkerProc, wait_for

    worker = WorkerProc(cluster.url, "fake:5", "gw-cluster-w", "--served-model-name", "fake-model", log_dir=tmp_path)
    # per-tenant limits and stream leases on a cluster: each tenant's counts share one hash tag, the leases one key
    limits = json.dumps({"*": {"max_queued_jobs": 2, "max_queued_tokens": 1000, "max_concurrent_streams": 1}})
    gw = GatewayProc(cluster.url, "--max-queue-depth", "1000", log_dir=tmp_path,
                     env={"PAGESTREAM_GATEWAY_TENANT_LIMITS": limits, "PAGESTREAM_GATEWAY_STREAM_RESUME_GRACE_S": "2"})
    try:
        worker.wait_ready()
        gw.wait_ready()
        wait_for(lambda: "fake-model" in Producer.from_url(cluster.url).live_models(), 30, "the worker's announcement")
        c = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=60)
        done = c.completions.create(model="fake-model", prompt="the quick brown fox", max_tokens=7, seed=11)
        assert done.choices[0].text == FakeEngine().expected_text("the quick brown fox", 11, 7)
        chunks = list(c.completions.create(model="fake-model", prompt="the quick brown fox", max_tokens=7, seed=11, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == done.choices[0].text
        for _ in range(3):  # released as each ends: the limit of 2 never refuses these
            assert c.completions.create(model="fake-model", prompt="again", max_tokens=3).choices[0].text
        with pytest.raises(openai.RateLimitError):  # a second stream while one is open: past max_concurrent_streams
            with c.completions.create(model="fake-model", prompt="hold", max_tokens=400, stream=True) as held:
                next(iter(held))
                c.completions.create(model="fake-model", prompt="two more", max_tokens=2, stream=True)
        # the queue's gauges read every shard stream of each lane (and the registry) on the cluster
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        time.sleep(0.3)  # past the window in which a scrape reuses the last one's figures
        text = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=10).text
        depth = {(s.labels["model_name"], s.labels["lane"]): s.value for f in text_string_to_metric_families(text)
                 if f.name == "pagestream_queue_depth" for s in f.samples}
        lanes = ("high", "normal", "low")  # the model's lanes, and the shared, model-less ones (model_name="")
        assert depth == {**{("fake-model", lane): 0 for lane in lanes}, **{("", f"shared:{lane}"): 0 for lane in lanes}}, text
    finally:
        gw.stop()
        worker.stop()
