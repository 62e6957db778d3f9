"""Issue 8, worker side: hostile lane entries against a real Redis and a real worker loop.

Raw XADDs bypass the producer, so everything here is written straight to the lane
stream the way a careless or hostile client could. Each bad entry must end with a
failed result the producer can read (when it names a job) and a DLQ copy; good jobs
beside it must come out exact, charged one delivery, and nothing stays pending.
"""
from __future__ import annotations

import json
import threading

import redis

from pagestream.producer import JobStatus
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.schema import JobResult
from pagestream.worker.consumer import Consumer
from pagestream.worker.fake_engine import FakeConfig, FakeEngine
from pagestream.worker.publisher import Delta, Final, Publisher
from pagestream.worker.settings import WorkerSettings
from pagestream.worker.worker import Worker
from tests.queue_helpers import assert_contiguous, wait_for

LANE = keys.jobs_stream("normal")


def make_worker(r, redis_url, **kw) -> Worker:
    kw.setdefault("consumer", "w1")
    kw.setdefault("publish_interval_ms", 2)
    settings = WorkerSettings(redis_url=redis_url, **kw)
    return Worker(r, FakeEngine(FakeConfig(max_num_seqs=settings.max_num_seqs or 8)), settings)


def _raw_job(job_id: str, extra: bytes = b"") -> bytes:
    # written by hand, as a raw XADD would: JSON escapes reach the worker unparsed
    return b'{"job_id": "' + job_id.encode() + b'", "prompt": "hostile", "max_tokens": 3' + extra + b"}"


HOSTILE = {
    "surrogate-meta": _raw_job("surrogate-meta", b', "metadata": {"k": "\\ud800"}'),
    "surrogate-key": _raw_job("surrogate-key", b', "metadata": {"\\udfff": 1}'),
    "bomb": _raw_job("bomb", b', "metadata": {"deep": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
    "bomb-open": _raw_job("bomb-open", b', "metadata": ' + b"[" * 200_000),  # never closed
    "nan": _raw_job("nan", b', "temperature": NaN'),
    "huge-float": _raw_job("huge-float", b', "temperature": 1e999'),
    "huge-int": _raw_job("huge-int", b', "max_tokens": ' + b"9" * 5000),
    "cut-short": _raw_job("cut-short")[:-12],
}


def _good_jobs(producer, n: int, tag: str) -> dict[str, tuple[str, int]]:
    return {producer.submit(prompt=f"{tag} {i}", max_tokens=9, seed=i): (f"{tag} {i}", i) for i in range(n)}


def _assert_exact(r, producer, engine, jobs: dict[str, tuple[str, int]]) -> None:
    for jid, (prompt, seed) in jobs.items():
        res = producer.result(jid, timeout=30)
        assert res.status == JobStatus.COMPLETED and res.deliveries == 1, res
        assert res.text == engine.expected_text(prompt, seed=seed, max_tokens=9) == assert_contiguous(r, jid)


def test_surrogates_bombs_and_broken_numbers_fail_alone_and_neighbours_stay_exact(r, redis_url, producer):
    good = _good_jobs(producer, 3, "before")
    for i in range(12):  # twelve of the entry that used to stall a worker for good
        r.xadd(LANE, {"job": _raw_job(f"sur-{i}", b', "metadata": {"k": "\\ud800"}')})
    for raw in HOSTILE.values():
        r.xadd(LANE, {"job": raw})
    good |= _good_jobs(producer, 3, "after")
    w = make_worker(r, redis_url, max_num_seqs=4)
    w.run(burst=True)

    _assert_exact(r, producer, w.engine, good)
    reasons = {
        "surrogate-meta": "lone surrogate", "surrogate-key": "lone surrogate", "bomb": "nested deeper",
        "bomb-open": "nested deeper", "nan": "NaN", "huge-float": "out of range", "huge-int": "not valid JSON",
        "cut-short": "not valid JSON",
    }
    for jid, reason in reasons.items():  # each reaches the producer, saying why
        res = producer.result(jid, timeout=5)
        assert res.status == JobStatus.FAILED and reason in res.error, (jid, res.error)
    assert all(producer.result(f"sur-{i}", timeout=5).status == JobStatus.FAILED for i in range(12))
    assert r.xlen(keys.dead_letter_stream()) == 12 + len(HOSTILE)
    assert r.xpending(LANE, "workers")["pending"] == 0


def test_oversized_entry_fails_unparsed_and_the_dlq_keeps_a_truncated_copy(r, redis_url, producer):
    big = _raw_job("too-big", b', "metadata": {"pad": "' + b"x" * (600 * 1024) + b'"}')
    r.xadd(LANE, {"job": big})
    r.xadd(LANE, {"job": b'{"prompt": "' + b"y" * (600 * 1024) + b'", "job_id": "id-at-the-end"}'})
    good = _good_jobs(producer, 2, "beside")
    w = make_worker(r, redis_url, max_entry_bytes=512 * 1024, dead_letter_payload_bytes=4096)
    w.run(burst=True)

    _assert_exact(r, producer, w.engine, good)
    res = producer.result("too-big", timeout=5)
    assert res.status == JobStatus.FAILED and "at most 524288" in res.error
    dead = r.xrange(keys.dead_letter_stream())
    assert len(dead) == 2
    for _, fields in dead:
        assert len(fields[b"payload:job"]) <= 4096
        assert json.loads(fields[b"truncated"])["entry_bytes"] > 600 * 1024
        assert "max_entry_bytes" in json.loads(fields[b"meta"])["reason"]
    assert json.loads(dead[1][1][b"meta"])["job_id"] is None  # its id is past what is scanned: no guess
    assert r.xpending(LANE, "workers")["pending"] == 0


def test_a_broken_payload_that_names_its_job_once_gets_a_failed_result(r, redis_url, producer):
    r.xadd(LANE, {"job": _raw_job("named-once", b', "metadata": {"k": "\\ud800"}')})
    # names two jobs: writing a failed result to either could clobber someone else's job
    r.xadd(LANE, {"job": b'{"job_id": "one", "metadata": {"job_id": "two", "x": "\\udc00"}}'})
    w = make_worker(r, redis_url)
    w.run(burst=True)
    assert producer.result("named-once", timeout=5).status == JobStatus.FAILED
    assert producer.status("one") is None and producer.status("two") is None
    metas = [json.loads(f[b"meta"]) for _, f in r.xrange(keys.dead_letter_stream())]
    assert [m["job_id"] for m in metas] == ["named-once", None]


def test_publisher_fails_only_the_item_it_cannot_write(r, redis_url):
    settings = WorkerSettings(redis_url=redis_url, consumer="pub")
    consumer = Consumer(r, settings)
    consumer.ensure_groups()
    for i in range(4):
        r.xadd(LANE, {"job": b"{}"})
    entries = [e[0].decode() for e in r.xreadgroup("workers", "pub", {LANE: ">"})[0][1]]
    pub = Publisher(r, consumer, interval_s=0.001)
    pub.start()
    items: list[object] = []
    for i, eid in enumerate(entries):
        jid = f"job-{i}"
        items.append(Delta(jid, 0, 0, [1, 2, 3], "abc"))
        meta = {"k": "\ud800"} if i == 1 else {"i": i}  # a result that cannot be encoded as UTF-8
        text = "x\udfff" if i == 2 else "abc"  # a token event that cannot either
        items.append(Delta(jid, 0, 3, [4], text, "length"))
        items.append(Final(JobResult(job_id=jid, status=JobStatus.COMPLETED, text="abc" + text, metadata=meta), 3600, ("normal", eid)))
    pub.put(items)
    assert pub.flush(timeout=30)
    pub.stop()
    for i in (0, 3):
        res = JobResult.model_validate_json(r.hget(keys.job_hash(f"job-{i}"), "result"))
        assert res.status == JobStatus.COMPLETED and res.metadata == {"i": i}
        assert assert_contiguous(r, f"job-{i}") == "abcabc"
    for i in (1, 2):
        res = JobResult.model_validate_json(r.hget(keys.job_hash(f"job-{i}"), "result"))
        assert res.status == JobStatus.FAILED and "could not be written" in res.error
    assert r.xpending(LANE, "workers")["pending"] == 0  # every entry settled, none leased forever


def test_running_jobs_keys_expire_and_a_huge_result_ttl_is_capped(r, redis_url, producer):
    jid = producer.submit(prompt="long runner", max_tokens=400, seed=1)
    r.xadd(LANE, {"job": json.dumps({"job_id": "forever", "prompt": "p", "max_tokens": 2, "result_ttl_s": 10**17})})
    w = make_worker(r, redis_url, max_num_seqs=2)
    try:
        w.run(max_steps=5)
        w.publisher.flush(10)
        assert producer.status(jid) == JobStatus.RUNNING
        assert 0 < r.ttl(keys.job_hash(jid)) and 0 < r.ttl(keys.out_stream(jid))  # a dead worker leaks nothing
        w.run(burst=True)
    finally:
        w.close()
    assert producer.result("forever", timeout=5).status in (JobStatus.COMPLETED, JobStatus.FAILED)
    assert 0 < r.ttl(keys.job_hash("forever")) <= 366 * 24 * 3600


def test_consumer_groups_are_recreated_after_redis_loses_them(r, redis_url, producer):
    w = make_worker(r, redis_url, block_ms=50)
    t = threading.Thread(target=w.run)
    t.start()
    try:
        first = _good_jobs(producer, 2, "first")
        _assert_exact(r, producer, w.engine, first)
        r.flushdb()  # what FLUSHALL or a restart without persistence leaves: no streams, no groups
        second = _good_jobs(producer, 3, "second")
        _assert_exact(r, producer, w.engine, second)
        assert r.xinfo_groups(LANE)[0]["name"] == b"workers"
    finally:
        w.request_stop()
        t.join(30)
    assert not t.is_alive()


def test_groups_lost_while_jobs_run_are_recreated_and_new_jobs_run(r, redis_url, producer):
    engine = FakeEngine(FakeConfig(max_num_seqs=4, step_delay_s=0.02))
    settings = WorkerSettings(redis_url=redis_url, consumer="w1", publish_interval_ms=2, block_ms=50, lease_ms=300)
    w = Worker(r, engine, settings)
    t = threading.Thread(target=w.run)
    t.start()
    try:
        running = producer.submit(prompt="in flight", max_tokens=480)  # ~10 s of steps
        wait_for(lambda: producer.status(running) == JobStatus.RUNNING, 30, "a job running")
        r.flushdb()
        after = _good_jobs(producer, 3, "after the flush")
        _assert_exact(r, producer, engine, after)
        wait_for(lambda: engine.stats().num_running == 0, 30, "the lost job dropped from the engine")
    finally:
        w.request_stop(cold=True)
        t.join(30)
    assert not t.is_alive()
    assert redis.Redis.from_url(redis_url).xpending(LANE, "workers")["pending"] == 0


def test_a_redis_restart_without_persistence_is_survived(tmp_path):
    """A private redis-server (no RDB, no AOF) killed and started again on the same port."""
    from pagestream.producer import Producer
    from tests.queue_helpers import start_redis_server

    proc, url = start_redis_server(tmp_path)
    client = redis.Redis.from_url(url)
    engine = FakeEngine(FakeConfig(max_num_seqs=4))
    w = Worker(client, engine, WorkerSettings(redis_url=url, consumer="w1", publish_interval_ms=2, block_ms=50))
    t = threading.Thread(target=w.run)
    t.start()
    try:
        with Producer.from_url(url) as p:
            _assert_exact(client, p, engine, _good_jobs(p, 2, "before"))
        proc.kill()
        proc.wait(10)
        proc, url = start_redis_server(tmp_path, port=client.connection_pool.connection_kwargs["port"])
        with Producer.from_url(url) as p:
            _assert_exact(client, p, engine, _good_jobs(p, 3, "after"))
    finally:
        w.request_stop()
        t.join(30)
        proc.kill()
        proc.wait(10)
    assert not t.is_alive()
