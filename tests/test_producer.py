"""Producer side against a real Redis: validation at submit, idempotency, cancel, result/stream plumbing."""
from __future__ import annotations

import asyncio
import json

import pytest
import redis

from pagestream.producer import AsyncProducer, JobNotFound, JobRequest, JobStatus
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.wire import token_event_fields, end_fields


def test_schema_roundtrip_and_flat_sampling():
    j = JobRequest(prompt="hi", max_tokens=8, seed=3, temperature=0.5, output={"kind": "bulk", "bulk_id": "b1", "custom_id": "c-1"})
    assert j.sampling.max_tokens == 8 and j.sampling.seed == 3
    assert JobRequest.model_validate_json(j.model_dump_json()) == j
    assert j.schema_version == 1


@pytest.mark.parametrize(
    "fields, msg",
    [
        ({"prompt": "x", "lane": "urgent"}, "lane"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"prompt": "bad \udcff bytes"}, "UTF-8"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "UTF-8"),
        ({"messages": [{"role": "", "content": "x"}]}, "role"),
        ({}, "exactly one of"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one of"),
        ({"prompt": ""}, "empty"),
        ({"prompt": "x", "job_id": "has{brace}"}, "job_id"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ({"prompt": "x", "output": {"kind": "bulk"}}, "bulk_id"),
        ({"prompt": "x", "schema_version": 99}, "schema_version"),
    ],
)
def test_submit_rejects_bad_input_with_a_clear_error(producer, r, fields, msg):
    with pytest.raises(ValueError) as exc:
        producer.submit(**fields)
    assert msg in str(exc.value)
    assert all(r.xlen(keys.jobs_stream(lane)) == 0 for lane in keys.LANES)


def test_submit_is_idempotent_by_job_id(producer, r):
    assert producer.submit(prompt="first", job_id="job-1") == "job-1"
    assert producer.submit(prompt="second", job_id="job-1") == "job-1"
    ids = producer.submit_many([{"prompt": "a", "job_id": "job-1"}, {"prompt": "b", "job_id": "job-2"}, JobRequest(prompt="c", lane="high")])
    assert ids[:2] == ["job-1", "job-2"]
    assert r.xlen(keys.jobs_stream("normal")) == 2
    assert r.xlen(keys.jobs_stream("high")) == 1
    entry = r.xrange(keys.jobs_stream("normal"), count=1)[0][1]
    assert json.loads(entry[b"job"])["prompt"] == "first"
    assert producer.status("job-1") == JobStatus.QUEUED


@pytest.mark.also_on_cluster
def test_cancel_queued_job_gives_cancelled_result(producer):
    jid = producer.submit(prompt="x")
    assert producer.cancel(jid) == JobStatus.QUEUED
    res = producer.result(jid, timeout=1)
    assert res.status == JobStatus.CANCELLED
    assert producer.cancel(jid) == JobStatus.CANCELLED  # already final: nothing changes
    assert list(producer.stream(jid, timeout=2)) == []
    assert producer.cancel("nope") is None


@pytest.mark.also_on_cluster
def test_result_timeout_and_unknown_job(producer):
    jid = producer.submit(prompt="x")
    with pytest.raises(TimeoutError):
        producer.result(jid, timeout=0.2)
    with pytest.raises(JobNotFound):
        producer.result("never-submitted", timeout=0.2)


@pytest.mark.also_on_cluster
def test_stream_drops_repeated_indices_and_resumes_from_index(producer, r):
    # What a subscriber sees when a presumed-dead worker and its successor both published.
    jid = producer.submit(prompt="x")
    out = keys.out_stream(jid)
    for fields in [
        token_event_fields(0, 0, [1, 2], "ab", None),
        token_event_fields(0, 2, [3], "c", None),
        token_event_fields(0, 0, [1, 2, 3], "abc", None),  # replay
        token_event_fields(0, 3, [4], "d", None),
        token_event_fields(0, 4, [], "!", "stop"),
        token_event_fields(0, 4, [], "!", "stop"),  # replay of the text-only final delta
        end_fields("completed"),
    ]:
        r.xadd(out, fields)
    evs = list(producer.stream(jid))
    assert "".join(e.text for e in evs) == "abcd!"
    assert [t for e in evs for t in e.token_ids] == [1, 2, 3, 4]
    later = list(producer.stream(jid, from_index=3))
    assert [e.index for e in later] == [3, 4]


@pytest.mark.also_on_cluster
def test_async_producer(redis_url):
    async def main():
        p = AsyncProducer.from_url(redis_url)
        jid = await p.submit(prompt="x", job_id="a-1", max_tokens=2)
        assert await p.submit(prompt="y", job_id="a-1") == "a-1"
        assert await p.submit_many([{"prompt": "z"}, {"prompt": "w"}])
        assert await p.status(jid) == JobStatus.QUEUED
        with pytest.raises(ValueError):
            await p.submit(prompt="x", lane="nope")
        assert await p.cancel(jid) == JobStatus.QUEUED
        res = await p.result(jid, timeout=1)
        assert res.status == JobStatus.CANCELLED
        assert [e async for e in p.stream(jid, timeout=2)] == []
        await p.aclose()

    asyncio.run(main())


def test_submit_takes_a_jobrequest_or_a_dict_as_the_issue_documents(producer, r):
    jid = producer.submit(JobRequest(prompt="from a model", job_id="req-1", max_tokens=4))
    assert jid == "req-1" and producer.status("req-1") == JobStatus.QUEUED
    assert producer.submit({"prompt": "from a dict", "max_tokens": 4}, job_id="req-2") == "req-2"
    with r.pipeline(transaction=False) as pipe:
        producer.submit(JobRequest(prompt="in a pipeline", job_id="req-3"), pipeline=pipe)
        pipe.execute()
    assert producer.status("req-3") == JobStatus.QUEUED
    with pytest.raises(TypeError, match="not both"):
        producer.submit(JobRequest(prompt="x"), prompt="y")


def test_bulk_keys_live_in_producer_keys_with_one_hash_tag_per_bulk(redis_url):
    """pagestream.producer.protocol.keys names every key a bulk writes, with the key strings bulks already in Redis use."""
    import importlib

    from pagestream.producer.bulk.api import cancel_bulk, create_bulk

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pagestream.producer.bulk_keys")
    bid = "b-keys"
    assert keys.bulk_hash(bid) == "ps:bulk:{b-keys}"
    assert [keys.bulk_done_set(bid), keys.bulk_seen_hash(bid), keys.bulk_lock(bid), keys.bulk_rescue_marker(bid),
            keys.bulk_part_seq(bid)] == [f"ps:bulk:{{b-keys}}:{s}" for s in ("done", "seen", "lock", "rescue", "partseq")]
    assert keys.bulk_index() == "ps:bulks"
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    create_bulk("in.jsonl", "out", connection=c, bulk_id=bid)
    cancel_bulk(c, bid)
    # everything create/cancel wrote is named by producer.protocol.keys
    assert set(c.keys("*")) == {keys.bulk_hash(bid), keys.bulk_index()}
    assert c.hget(keys.bulk_hash(bid), "status") == "cancelling"
    assert c.zscore(keys.bulk_index(), bid) is not None


@pytest.mark.also_on_cluster
def test_a_queued_job_hash_expires_if_no_worker_ever_starts_it(producer, r):
    """Issue 8 item 7: a job nobody runs must not leave its keys forever."""
    from pagestream.producer.client.core import QUEUED_JOB_KEY_TTL_S

    job_id = producer.submit(prompt="never run", max_tokens=4, result_ttl_s=60)
    ttl = r.ttl(keys.job_hash(job_id))
    assert 0 < ttl <= QUEUED_JOB_KEY_TTL_S + 61
    with_deadline = producer.submit(prompt="run within a minute or never", max_tokens=4, ttl_s=60, result_ttl_s=60)
    assert 0 < r.ttl(keys.job_hash(with_deadline)) <= 121


def _finish(r, job_id: str, text: str) -> None:
    """What a worker leaves when a job ends: a token event, then its result and end entry together."""
    from pagestream.producer.protocol.schema import JobResult

    out = keys.out_stream(job_id)
    r.xadd(out, token_event_fields(0, 0, [7], text, "stop"))
    pipe = r.pipeline(transaction=False)
    pipe.hset(keys.job_hash(job_id), mapping={"status": "completed", "result": JobResult(
        job_id=job_id, status=JobStatus.COMPLETED, text=text, token_ids=[7]).model_dump_json()})
    pipe.xadd(out, end_fields("completed"))
    pipe.execute()


@pytest.mark.also_on_cluster
def test_results_waits_for_many_jobs_and_returns_them_in_order(producer, r):
    import threading
    import time

    ids = producer.submit_many([{"prompt": f"p{i}"} for i in range(4)])

    def worker():  # finishes them in reverse order, 50 ms apart
        for i in reversed(range(4)):
            time.sleep(0.05)
            r.xadd(keys.out_stream(ids[i]), token_event_fields(0, 0, [], "", None))  # a wake that is not the end
            _finish(r, ids[i], f"answer {i}")

    t = threading.Thread(target=worker)
    t0 = time.monotonic()
    t.start()
    got = producer.results([ids[2], *ids], timeout=30)  # a repeated id is answered twice
    took = time.monotonic() - t0
    t.join()
    assert [res.text for res in got] == ["answer 2", "answer 0", "answer 1", "answer 2", "answer 3"]
    assert all(res.status == JobStatus.COMPLETED for res in got)
    if not producer.core.cluster:  # woken by the end entries, not by a blocking read running out (1 s)
        assert took < 0.9, took


@pytest.mark.also_on_cluster
def test_results_unknown_job_and_timeout(producer, r):
    done, running = producer.submit_many([{"prompt": "a"}, {"prompt": "b"}])
    _finish(r, done, "ok")
    with pytest.raises(JobNotFound):
        producer.results([done, "never-submitted"], timeout=1)
    with pytest.raises(TimeoutError, match="not finished"):
        producer.results([done, running], timeout=0.3)
    assert [res.text for res in producer.results([done], timeout=1)] == ["ok"]


def test_async_results(redis_url, r):
    async def main():
        p = AsyncProducer.from_url(redis_url)
        ids = await p.submit_many([{"prompt": "a"}, {"prompt": "b"}])
        for i, job_id in enumerate(ids):
            _finish(r, job_id, f"a{i}")
        assert [res.text for res in await p.results(ids, timeout=2)] == ["a0", "a1"]
        await p.aclose()

    asyncio.run(main())
