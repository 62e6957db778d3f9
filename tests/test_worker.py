"""The worker loop in-process against a real Redis (rq's ``work(burst=True)`` style).

Queue behaviour is driven by the instant fake engine (same interface as
LLMEngine); cancellation and KV-block freeing use the real engine on the tiny
Llama fixture.
"""
from __future__ import annotations

import json
import random
import time

import pytest
import redis

from pagestream.engine.errors import EngineDeadError
from pagestream.producer import JobStatus
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.schema import ErrorCode
from tests.queue_helpers import assert_contiguous, stream_of_job, wait_for
from pagestream.worker.fake_engine import FakeConfig, FakeEngine
from pagestream.worker.settings import WorkerSettings
from pagestream.worker.worker import Worker


def make_worker(r, redis_url, engine=None, **kw) -> Worker:
    kw.setdefault("consumer", "w1")
    kw.setdefault("publish_interval_ms", 2)
    settings = WorkerSettings(redis_url=redis_url, **kw)
    engine = engine or FakeEngine(FakeConfig(max_num_seqs=settings.max_num_seqs or 8, max_model_len=settings.max_model_len or 512))
    return Worker(r, engine, settings)


@pytest.mark.also_on_cluster
def test_burst_completes_jobs_streams_equal_results_high_lane_first(r, redis_url, producer):
    w = make_worker(r, redis_url, max_num_seqs=4, prefetch=0)
    low = [producer.submit(prompt=f"low {i}", max_tokens=5, seed=i, lane="low") for i in range(6)]
    high = [producer.submit(prompt=f"high {i}", max_tokens=5, seed=i, lane="high") for i in range(4)]
    normal = [producer.submit(prompt=f"normal {i}", max_tokens=7, seed=i) for i in range(10)]
    w.run(burst=True)
    fake = w.engine
    results = {j: producer.result(j, timeout=2) for j in low + high + normal}
    for j, res in results.items():
        assert res.status == JobStatus.COMPLETED, res
        assert res.deliveries == 1 and res.resumed_from == 0
        streamed = "".join(e.text for e in producer.stream(j, timeout=2))
        assert streamed == res.text == assert_contiguous(r, j)
    assert results[normal[3]].text == fake.expected_text("normal 3", seed=3, max_tokens=7)
    # the first batch the engine took was the high lane
    first_starts = sorted(results.values(), key=lambda x: x.started_at)[:4]
    assert {x.job_id for x in first_starts} == set(high)
    for lane in keys.LANES:
        assert r.xpending(keys.jobs_stream(lane), "workers")["pending"] == 0


def _malformed_entries(rng: random.Random, n: int) -> list[dict]:
    good = {"job_id": "x", "prompt": "hello", "max_tokens": 2}
    makers = [
        lambda i: {b"job": rng.randbytes(rng.randint(0, 40))},  # random bytes (mostly not UTF-8)
        lambda i: {b"job": b"\xff\xfe" + json.dumps(good).encode()},  # non-UTF-8 prefix
        lambda i: {b"job": json.dumps(good)[: rng.randint(1, 30)].encode()},  # truncated JSON
        lambda i: {b"other": b"field"},  # no job field
        lambda i: {b"job": json.dumps({**good, "job_id": f"m-{i}", "temperature": -rng.random() - 0.1}).encode()},
        lambda i: {b"job": json.dumps({**good, "job_id": f"m-{i}", "max_tokens": "many"}).encode()},
        lambda i: {b"job": json.dumps({"job_id": f"m-{i}"}).encode()},  # no prompt
        lambda i: {b"job": json.dumps({**good, "job_id": f"m-{i}", "lane": "high"}).encode()},  # wrong lane for the stream
        lambda i: {b"job": json.dumps({**good, "job_id": f"m-{i}", "lane": "warp"}).encode()},  # unknown lane
        lambda i: {b"job": json.dumps([1, 2, 3]).encode()},
        lambda i: {b"job": json.dumps({**good, "job_id": f"m-{i}", "messages": [{"role": "user"}], "prompt": None}).encode()},
        lambda i: {b"job": json.dumps({**good, "job_id": "{evil}"}).encode()},
        lambda i: {b"job": json.dumps({**good, "job_id": f"m-{i}", "schema_version": 7}).encode()},
    ]
    return [makers[i % len(makers)](i) for i in range(n)]


@pytest.mark.also_on_cluster
def test_fuzz_malformed_entries_end_in_dlq_and_worker_keeps_serving(r, redis_url, producer):
    rng = random.Random(0)
    bad = _malformed_entries(rng, 520)
    valid = []
    for i, fields in enumerate(bad):
        r.xadd(keys.jobs_stream("normal"), fields)
        if i % 40 == 0:
            valid.append(producer.submit(prompt=f"valid {i}", max_tokens=3, seed=i))
    w = make_worker(r, redis_url, max_num_seqs=8)
    w.run(burst=True)
    for j in valid:
        assert producer.result(j, timeout=2).status == JobStatus.COMPLETED
    assert r.xlen(keys.dead_letter_stream()) == len(bad)
    assert r.xpending(keys.jobs_stream("normal"), "workers")["pending"] == 0
    # each dead letter says why, and keeps the raw payload
    for _, fields in r.xrange(keys.dead_letter_stream(), count=50):
        meta = json.loads(fields[b"meta"])
        assert meta["reason"] and meta["lane"] == "normal"
        assert any(k.startswith(b"payload:") for k in fields)
    # a malformed job that names itself gets a failed result the producer can read
    res = producer.result("m-4", timeout=1)
    assert res.status == JobStatus.FAILED and "temperature" in res.error
    res = producer.result("m-8", timeout=1)
    assert res.status == JobStatus.FAILED and "lane" in res.error


@pytest.mark.also_on_cluster
def test_poison_job_is_dead_lettered_after_max_deliveries(r, redis_url, producer):
    jid = producer.submit(prompt="poison", max_tokens=2)
    stream = stream_of_job(r, jid)
    r.xgroup_create(stream, "workers", id="0")
    # three earlier deliveries to consumers that died holding it (XCLAIM bumps the counter)
    (entry_id, _), = r.xreadgroup("workers", "dead-1", {stream: ">"})[0][1]
    r.xclaim(stream, "workers", "dead-2", 0, [entry_id])
    r.xclaim(stream, "workers", "dead-3", 0, [entry_id], idle=10_000)
    w = make_worker(r, redis_url, max_deliveries=3, lease_ms=1000)
    w.run(burst=True)
    res = producer.result(jid, timeout=1)
    assert res.status == JobStatus.FAILED and "max_deliveries=3" in res.error
    (_, fields), = r.xrange(keys.dead_letter_stream())
    assert json.loads(fields[b"meta"])["deliveries"] == 4
    assert r.xpending(stream, "workers")["pending"] == 0


def test_engine_rejection_is_a_failed_result(r, redis_url, producer):
    w = make_worker(r, redis_url, max_model_len=32)
    long_job = producer.submit(prompt="word " * 40, max_tokens=4)
    ok = producer.submit(prompt="short", max_tokens=4)
    w.run(burst=True)
    res = producer.result(long_job, timeout=1)
    assert res.status == JobStatus.FAILED and "max_model_len" in res.error
    assert res.error_code == ErrorCode.INVALID_INPUT  # the request's own fault: the gateway answers it 400
    assert producer.result(ok, timeout=1).status == JobStatus.COMPLETED
    assert r.xlen(keys.dead_letter_stream()) == 0  # not a poison entry: re-driving it would be refused again


def test_expired_job_is_never_started(r, redis_url, producer):
    w = make_worker(r, redis_url)
    jid = producer.submit(prompt="late", max_tokens=4, ttl_s=0.05)
    time.sleep(0.1)
    w.run(burst=True)
    res = producer.result(jid, timeout=1)
    assert res.status == JobStatus.EXPIRED and res.started_at is None and res.token_ids == []
    assert w.engine.stats().num_generated_tokens == 0


def test_pel_never_exceeds_admission_plus_prefetch(r, redis_url, producer):
    producer.submit_many([{"prompt": f"p {i}", "max_tokens": 3} for i in range(400)])
    w = make_worker(r, redis_url, max_num_seqs=8, prefetch=2)
    peak = steps = 0
    try:
        while w.run(burst=True, max_steps=1):  # 0 steps: the queue is empty and the worker tore down
            steps += 1
            pend = r.xpending(keys.jobs_stream("normal"), "workers")["pending"]
            peak = max(peak, pend)
            assert pend <= 8 + 2
    finally:
        w.close()
    assert peak == 10 and steps >= 400 * 3 / 8
    assert r.xpending(keys.jobs_stream("normal"), "workers")["pending"] == 0
    assert r.xinfo_groups(keys.jobs_stream("normal"))[0]["lag"] == 0


def test_logprobs_ride_the_token_events_and_the_result(r, redis_url, producer):
    w = make_worker(r, redis_url, max_num_seqs=4, publish_interval_ms=20)  # coalesced events: lists must join up
    with_lp = producer.submit(prompt="tell me odds", max_tokens=9, seed=4, logprobs=3)
    two = producer.submit(prompt="two samples", max_tokens=5, seed=6, n=2, logprobs=0)
    plain = producer.submit(prompt="no odds", max_tokens=4, seed=5)
    w.run(burst=True)
    fake = w.engine
    want = fake.expected_logprobs("tell me odds", 4, 9, k=3)
    res = producer.result(with_lp, timeout=2)
    events = list(producer.stream(with_lp, timeout=2))
    streamed = [lp for e in events for lp in e.logprobs]
    assert all(len(e.logprobs) == len(e.token_ids) for e in events)
    assert [lp.model_dump() for lp in streamed] == [lp.model_dump() for lp in res.logprobs] == res.model_dump()["outputs"][0]["logprobs"]
    assert [lp.token_id for lp in res.logprobs] == res.token_ids
    for lp, engine_lp in zip(res.logprobs, want, strict=True):
        assert lp.token == f"<{lp.token_id}>" and lp.logprob == engine_lp[lp.token_id]
        assert [(a.token_id, a.token, a.logprob) for a in lp.top_logprobs] == [(t, f"<{t}>", v) for t, v in engine_lp.items()]
    res2 = producer.result(two, timeout=2)
    for s in res2.outputs:
        assert len(s.logprobs) == 5 and all(lp.top_logprobs == [] for lp in s.logprobs)
        assert [lp.logprob for lp in s.logprobs] == [d[t] for d, t in zip(fake.expected_logprobs("two samples", 6, 5, 1, s.index), s.token_ids)]
    # a job that did not ask has no logprobs anywhere, and its events are what they were before logprobs existed
    assert producer.result(plain, timeout=2).logprobs is None
    assert all(e.logprobs is None for e in producer.stream(plain, timeout=2))
    raw = [json.loads(f[b"ev"]) for _, f in r.xrange(keys.out_stream(plain)) if b"ev" in f]
    assert raw and all(set(ev) <= {"s", "i", "t", "x", "f"} for ev in raw[1:])
    # its first event adds only the prompt's size (a stream's continuous usage reads it), no prompt ids or logprobs
    assert set(raw[0]) <= {"s", "i", "t", "x", "f", "n"} and raw[0]["n"] == 2
    # the field is a count: chat's habit (True) and out-of-range counts are refused at submit, naming it
    for bad, why in ((True, "not true/false"), (21, "less than or equal to 20"), (-1, "greater than or equal to 0")):
        with pytest.raises(ValueError, match=why):
            producer.submit(prompt="x", logprobs=bad)


def test_token_texts_keep_the_top_k_and_write_only_finite_logprobs():
    from pagestream.worker.logprobs import TokenTexts

    class Tok:
        calls = 0

        def decode(self, ids):
            Tok.calls += 1
            return "".join(chr(96 + i) for i in ids)

    tt = TokenTexts(Tok())
    # the engine's dict: top-2 (ids 1, 2) then the sampled token 3 outside them; -inf and NaN cannot cross JSON
    out = tt.encode([3, 1], [{1: -0.5, 2: -1.0, 3: float("-inf")}, {1: float("nan"), 2: -2.0}], k=2)
    assert out == [[3, "c", -9999.0, [[1, "a", -0.5], [2, "b", -1.0]]], [1, "a", -9999.0, [[2, "b", -2.0], [1, "a", -9999.0]]]]
    assert Tok.calls == 3  # each id decoded once
    assert TokenTexts().encode([7], [{7: -0.1}], k=0) == [[7, "token_id:7", -0.1, []]]  # a model without a tokenizer


@pytest.mark.also_on_cluster
def test_cancel_running_job_stops_within_one_step_and_frees_blocks(r, redis_url, producer, tiny_llama_dir):
    from pagestream.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, device="cpu", max_num_seqs=4, seed=0))
    total = engine.stats().num_total_blocks
    w = make_worker(r, redis_url, engine=engine, max_num_seqs=4)
    jid = producer.submit(prompt="a long story about " * 8, max_tokens=200, temperature=0.8, seed=1)
    other = producer.submit(prompt="short", max_tokens=6, seed=2, temperature=0.8)
    try:
        w.run(max_steps=3)
        assert engine.stats().num_free_blocks < total
        assert w.publisher.flush(10)  # the start marker is the publisher thread's to write, off the step
        assert producer.cancel(jid) == JobStatus.RUNNING
        wait_for(lambda: w._cancel_requests, 5, "cancel to reach the worker")
        w.run(max_steps=1)
        res = producer.result(jid, timeout=5)
        assert res.status == JobStatus.CANCELLED
        assert res.completion_tokens <= 3 + 1  # tokens when cancelled, plus at most one step
        assert engine.stats().num_running == 1  # only the other job
        w.run(burst=True)
    finally:
        w.close()
    assert producer.result(other, timeout=5).status == JobStatus.COMPLETED
    st = engine.stats()
    assert st.num_running == 0 and st.num_free_blocks == total


def test_worker_reconnects_when_redis_drops_its_connections(r, redis_url, producer):
    import threading

    client = redis.Redis.from_url(redis_url, client_name="ps-test-reconnect")
    w = make_worker(client, redis_url, engine=FakeEngine(FakeConfig(max_num_seqs=8, step_delay_s=0.01)), max_num_seqs=8)
    ids = [producer.submit(prompt=f"job {i}", max_tokens=30, seed=i) for i in range(24)]
    t = threading.Thread(target=w.run)
    t.start()
    try:
        wait_for(lambda: w.num_steps >= 10, 10, "work under way")
        killed = 0
        for _ in range(3):  # drop every connection of the worker, a few times
            for c in r.client_list():
                if c.get("name") == "ps-test-reconnect":
                    killed += r.client_kill_filter(_id=c["id"])
            time.sleep(0.2)
        assert killed >= 3
        # A read whose reply the dropped connection lost leaves its entries in this consumer's PEL unknown to it:
        # the next reclaim round (every lease_ms / 4) finds and starts them, well before their lease would lapse.
        deadline = time.monotonic() + 30 + w.settings.reclaim_every_s
        for j in ids:
            res = producer.result(j, timeout=max(1.0, deadline - time.monotonic()))
            assert res.status == JobStatus.COMPLETED
            assert "".join(e.text for e in producer.stream(j, timeout=5)) == res.text
            assert res.text == w.engine.expected_text(f"job {ids.index(j)}", seed=ids.index(j), max_tokens=30)
    finally:
        w.request_stop()
        t.join(30)
    assert not t.is_alive()



@pytest.mark.also_on_cluster
def test_entries_a_lost_read_left_in_its_pel_start_at_the_next_reclaim_round_not_after_their_lease(r, redis_url, producer):
    # A read whose reply a dropped connection lost (redis-py retried the command on a fresh connection): Redis
    # delivered the entries to this consumer, so they are in its PEL, but the worker never saw them.
    w = make_worker(r, redis_url, consumer="w1", lease_ms=600_000, reclaim_interval_s=0.05)  # a lease that never ends here
    first = producer.submit(prompt="first", max_tokens=8, seed=9)
    try:
        for _ in range(50):  # started (its own PEL recovered, empty), then paused with `first` in flight
            w.run(max_steps=1)
            if w.jobs.num_running():
                break
        assert w.jobs.num_running() == 1
        ids = [producer.submit(prompt=f"lost {i}", max_tokens=3, seed=i) for i in range(3)]
        taken = set()
        for stream in {stream_of_job(r, j) for j in ids}:  # the read whose reply never reached the worker
            for _, entries in r.xreadgroup("workers", "w1", {stream: ">"}, count=10) or []:
                taken.update(json.loads(f[b"job"])["job_id"] for _, f in entries)
        assert taken == set(ids)
        time.sleep(0.1)  # a reclaim round is due
        w.run(burst=True)
    finally:
        w.close()
    assert producer.result(first, timeout=2).status == JobStatus.COMPLETED
    for i, j in enumerate(ids):
        res = producer.result(j, timeout=2)
        assert res.status == JobStatus.COMPLETED and res.deliveries == 2  # the lost read, then the worker's own
        assert res.text == w.engine.expected_text(f"lost {i}", seed=i, max_tokens=3)
        # not a takeover: a plain start, no reclaimed event
        evs = [e.type.value for e in producer.events(job=j) if e.type.value != "queued"]
        assert evs == ["started", "first_token", "finished"]
    assert r.xpending(stream_of_job(r, ids[0]), "workers")["pending"] == 0

def test_a_lost_read_recovered_after_another_worker_reclaimed_one_of_its_entries_leaves_that_one_alone(r, redis_url):
    # recover_unknown lists the consumer's PEL, then claims the entries it does not know again. Another worker
    # whose reclaim took one of them in between (its lease had lapsed) runs it: the recovery must not take it back.
    from pagestream.worker.consumer import Consumer

    stream = keys.jobs_stream("normal")
    ids = [r.xadd(stream, {"job": b"{}"}).decode() for _ in range(3)]
    c = Consumer(r, WorkerSettings(redis_url=redis_url, consumer="w1"))
    c.ensure_groups()
    r.xreadgroup("workers", "w1", {stream: ">"}, count=3)  # the read whose reply w1 never saw
    listed = [p["message_id"].decode() for p in r.xpending_range(stream, "workers", "-", "+", 10, consumername="w1")]
    assert listed == ids
    r.xclaim(stream, "workers", "w2", 0, [ids[1]])  # w2's reclaim, between the listing and the claim
    rows = c._pull_rows("normal", "ids", 3, 0, listed)
    assert [row[0].decode() for row in rows] == [ids[0], ids[2]]
    owners = {p["message_id"].decode(): p["consumer"].decode()
              for p in r.xpending_range(stream, "workers", "-", "+", 10)}
    assert owners == {ids[0]: "w1", ids[1]: "w2", ids[2]: "w1"}
    assert c.recover_unknown({("normal", ids[0])}, 10)[0].entry_id == ids[2]  # the whole call, from the top


def test_trim_drops_acked_entries_but_never_the_pending_backlog(r, redis_url):
    from pagestream.worker.consumer import Consumer

    stream = keys.jobs_stream("normal")
    ids = [r.xadd(stream, {"job": b"{}"}).decode() for _ in range(10)]
    c = Consumer(r, WorkerSettings(redis_url=redis_url, consumer="t"))
    c.ensure_groups()
    r.xreadgroup("workers", "t", {stream: ">"}, count=6)
    r.xack(stream, "workers", ids[0], ids[1], ids[2], ids[4], ids[5])  # ids[3] still pending; 6..9 never delivered
    assert c.trim()["normal"] == 3
    assert [e[0].decode() for e in r.xrange(stream)] == ids[3:]
    r.xack(stream, "workers", ids[3])
    c.trim()
    assert [e[0].decode() for e in r.xrange(stream)] == ids[6:]  # undelivered entries stay


class _StubSink:
    """Stands in for worker.bulk_sink.BulkSink: parts become durable when the test says so."""

    def __init__(self):
        self.added, self.durable, self.closed = [], [], False

    def add(self, lane, entry_id, job, result):
        self.added.append((lane, entry_id, job, result))

    def poll(self):
        out, self.durable = self.durable, []
        return out

    def close(self):
        self.closed = True
        return [(lane, eid) for lane, eid, _, _ in self.added]


def test_bulk_jobs_go_to_the_sink_and_are_acked_only_when_durable(r, redis_url, producer):
    sink = _StubSink()
    w = make_worker(r, redis_url)
    w.bulk.sink = sink
    out = {"kind": "bulk", "bulk_id": "b1", "custom_id": "c1"}
    r.hset(keys.bulk_hash("b1"), "status", "in_progress")  # a live bulk (a worker skips jobs of others)
    ok = producer.submit(prompt="bulk one", max_tokens=3, seed=1, output=out)
    r.xadd(keys.jobs_stream("normal"), {"job": json.dumps({"job_id": "bad-bulk", "prompt": "x", "temperature": -5, "output": {**out, "custom_id": "c2"}})})
    plain = producer.submit(prompt="plain", max_tokens=2)
    try:
        w.run(burst=True, max_steps=1)
        while w._busy():
            w.run(burst=True, max_steps=1)
        w.publisher.flush(2)
        stream = keys.jobs_stream("normal")
        assert r.xpending(stream, "workers")["pending"] == 2  # both bulk entries wait for durability
        by_id = {job.job_id: res for _, _, job, res in sink.added}
        assert by_id[ok].status == JobStatus.COMPLETED and len(by_id[ok].token_ids) == 3
        assert by_id["bad-bulk"].status == JobStatus.FAILED and "temperature" in by_id["bad-bulk"].error
        assert r.xlen(keys.out_stream(ok)) == 0  # no token events for bulk jobs
        assert producer.result(plain, timeout=2).status == JobStatus.COMPLETED
        first = sink.added[0][:2]
        sink.durable = [first]
        w._poll_sink()
        w.publisher.flush(2)
        assert r.xpending(stream, "workers")["pending"] == 1
    finally:
        w.close()
    assert sink.closed
    assert r.xpending(keys.jobs_stream("normal"), "workers")["pending"] == 0
    assert r.xlen(keys.dead_letter_stream()) == 1  # the invalid bulk job also leaves a DLQ copy


def test_settings_from_env_and_flags(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://example:6380/3")
    monkeypatch.setenv("PAGESTREAM_LANES", "low,high")
    monkeypatch.setenv("PAGESTREAM_LEASE_MS", "1500")
    s = WorkerSettings()
    assert (s.redis_url, s.lanes, s.lease_ms) == ("redis://example:6380/3", ["high", "low"], 1500)
    assert WorkerSettings(redis_url="redis://other", max_num_seqs=4).redis_url == "redis://other"
    with pytest.raises(ValueError, match="lanes"):
        WorkerSettings(lanes="urgent")


class _PoisonedEngine(FakeEngine):
    """Its step blows up whenever a request with 'poison' in the prompt is running."""

    def step(self):
        if any(req.prompt_token_ids == self.tokenizer.encode("poison pill") for req in {**self._running, **self._waiting}.values()):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return super().step()


def test_job_that_breaks_the_engine_step_is_dead_lettered_and_others_complete(r, redis_url, producer):
    engine = _PoisonedEngine(FakeConfig(max_num_seqs=1))
    w = make_worker(r, redis_url, engine=engine, max_num_seqs=1, prefetch=0, lease_ms=200, max_deliveries=3)
    w._sleep = lambda s: None  # no backoff sleeps in the test
    before = [producer.submit(prompt=f"fine {i}", max_tokens=3, seed=i) for i in range(2)]
    poison = producer.submit(prompt="poison pill", max_tokens=3)
    after = [producer.submit(prompt=f"fine {i}", max_tokens=3, seed=i) for i in range(2, 4)]
    import threading

    t = threading.Thread(target=w.run)
    t.start()
    try:
        res = producer.result(poison, timeout=20)
        assert res.status == JobStatus.FAILED and "max_deliveries=3" in res.error
        for j in before + after:
            assert producer.result(j, timeout=20).status == JobStatus.COMPLETED
    finally:
        w.request_stop()
        t.join(20)
    (_, fields), = r.xrange(keys.dead_letter_stream())
    assert json.loads(fields[b"meta"])["job_id"] == poison


class _DeadEngine(FakeEngine):
    """Fails every step once work arrives, as an engine whose tensor-parallel rank died does."""

    def step(self):
        if self._running or self._waiting:
            raise EngineDeadError("tensor-parallel rank 1 of 2 died (simulated)")
        return super().step()


def test_a_dead_engine_stops_the_worker_and_another_completes_its_jobs(r, redis_url, producer):
    ids = [producer.submit(prompt=f"job {i}", max_tokens=3, seed=i) for i in range(3)]
    w = make_worker(r, redis_url, engine=_DeadEngine(FakeConfig(max_num_seqs=4)), max_num_seqs=4, max_deliveries=1)
    raised = []

    def run():
        try:
            w.run()  # not burst: only the dead engine ends it
        except EngineDeadError as exc:
            raised.append(exc)

    import threading

    t = threading.Thread(target=run)
    t.start()
    t.join(20)
    if t.is_alive():
        w.request_stop(cold=True)
        t.join(20)
        pytest.fail("the worker kept serving on a dead engine")
    assert raised, "the worker stopped without raising EngineDeadError"
    # no job was failed or dead-lettered for the engine's death, not even with max_deliveries=1 ...
    assert not r.xrange(keys.dead_letter_stream())
    # ... and another worker takes them over at once (the dead one's entries are handed back)
    other = make_worker(r, redis_url, consumer="w2", max_num_seqs=4, max_deliveries=1)
    other.run(burst=True)
    for j in ids:
        assert producer.result(j, timeout=5).status == JobStatus.COMPLETED
    # handed back before any token: the dead worker's publisher kept no "first token still due" entry for them
    assert not w.publisher._first_token and not w.publisher._out_ttl


@pytest.mark.also_on_cluster
def test_restart_under_the_same_name_recovers_its_own_pel_at_once(r, redis_url, producer):
    ids = [producer.submit(prompt=f"own {i}", max_tokens=3, seed=i) for i in range(3)]
    for stream in {stream_of_job(r, j) for j in ids}:
        r.xgroup_create(stream, "workers", id="0")
        r.xreadgroup("workers", "w1", {stream: ">"}, count=3)  # a previous w1 read them and died
    w = make_worker(r, redis_url, consumer="w1", lease_ms=600_000)  # a lease that would never expire here
    w.run(burst=True)
    for j in ids:
        res = producer.result(j, timeout=2)
        assert res.status == JobStatus.COMPLETED and res.deliveries == 2
        # taken over from the earlier w1 (it had not started them): reclaimed goes with the new start
        evs = list(producer.events(job=j))
        evs = [e for e in evs if e.type.value != "queued"]  # (a cluster's submit writes no queued event)
        assert [e.type.value for e in evs] == ["reclaimed", "started", "first_token", "finished"]
        assert evs[0].fields["from_worker"] == evs[0].fields["worker"] == "w1" and evs[0].fields["deliveries"] == "2"


@pytest.mark.also_on_cluster
def test_worker_drops_a_job_whose_lease_another_consumer_took(r, redis_url, producer):
    w = make_worker(r, redis_url, engine=FakeEngine(FakeConfig(max_num_seqs=2)), max_num_seqs=2, lease_ms=3000)
    jid = producer.submit(prompt="contested", max_tokens=50, seed=1)
    try:
        w.run(max_steps=2)
        assert w.engine.stats().num_running == 1
        stream = stream_of_job(r, jid)
        (entry,) = r.xpending_range(stream, "workers", "-", "+", 10)
        r.xclaim(stream, "workers", "thief", 0, [entry["message_id"]])  # a live thief: idle < lease below
        wait_for(lambda: w._lost, 5, "the lease refresh to notice")
        assert w.run(burst=True, max_steps=1) == 0  # dropped: nothing left to step
        assert w.engine.stats().num_running == 0 and not w.jobs
        assert r.xpending_range(stream, "workers", "-", "+", 10)[0]["consumer"] == b"thief"  # not taken back
        w.publisher.flush(5)
        assert jid not in w.publisher._first_token and jid not in w.publisher._out_ttl  # forgotten with the job
        assert producer.status(jid) == JobStatus.RUNNING  # the thief owns its outcome now
    finally:
        w.close()


class _BuggyEngine(FakeEngine):
    def add_request(self, request_id, prompt=None, *a, **kw):
        if prompt == "trigger the bug":
            raise KeyError("an engine bug, not a validation error")
        return super().add_request(request_id, prompt, *a, **kw)


def test_engine_bug_on_one_job_fails_that_job_only(r, redis_url, producer):
    w = make_worker(r, redis_url, engine=_BuggyEngine(FakeConfig(max_num_seqs=4)), max_num_seqs=4)
    bad = producer.submit(prompt="trigger the bug", max_tokens=3)
    good = [producer.submit(prompt=f"ok {i}", max_tokens=3) for i in range(5)]
    w.run(burst=True)
    res = producer.result(bad, timeout=2)
    assert res.status == JobStatus.FAILED and "KeyError" in res.error
    assert all(producer.result(j, timeout=2).status == JobStatus.COMPLETED for j in good)
    assert r.xpending(keys.jobs_stream("normal"), "workers")["pending"] == 0


# ---- wiring between the queue path and the bulk path ------------------------------------------

class _CountingEngine(FakeEngine):
    """Records every request the worker hands it."""

    def __init__(self, config):
        super().__init__(config)
        self.added: list[str] = []

    def add_request(self, request_id, *a, **kw):
        self.added.append(request_id)
        return super().add_request(request_id, *a, **kw)


def _bulk(redis_url, tmp_path, bulk_id: str) -> str:
    from pagestream.producer.bulk.api import create_bulk

    c = redis.Redis.from_url(redis_url, decode_responses=True)
    create_bulk(str(tmp_path / "in.jsonl"), str(tmp_path / bulk_id), connection=c, bulk_id=bulk_id)
    c.hset(keys.bulk_hash(bulk_id), "status", "in_progress")  # as the orchestrator leaves it while feeding
    return bulk_id


def _bulk_job(bulk_id: str, i: int, tmp_path) -> dict:
    return {"job_id": f"{bulk_id}-L{i}", "prompt": f"line {i}", "max_tokens": 2, "seed": i, "lane": "low",
            "metadata": {"bulk_line": i},
            "output": {"kind": "bulk", "bulk_id": bulk_id, "custom_id": f"c{i}", "uri": str(tmp_path / bulk_id)}}


def test_jobs_of_a_cancelled_bulk_are_acked_without_reaching_the_engine(r, redis_url, producer, tmp_path):
    from pagestream.producer.bulk.api import cancel_bulk
    from pagestream.producer.protocol.schema import JobRequest
    from pagestream.producer.protocol.wire import job_fields

    live, dead = _bulk(redis_url, tmp_path, "b-live"), _bulk(redis_url, tmp_path, "b-dead")
    n = 20
    for i in range(1, n + 1):  # interleaved on one lane
        producer.submit_many([_bulk_job(dead, i, tmp_path), _bulk_job(live, i, tmp_path)])
    # a job of the dead bulk queued without a job hash (written straight to the stream)
    hashless = JobRequest.model_validate(_bulk_job(dead, n + 1, tmp_path))
    r.xadd(keys.jobs_stream("low"), job_fields(hashless))
    cancel_bulk(redis.Redis.from_url(redis_url, decode_responses=True), dead)
    engine = _CountingEngine(FakeConfig(max_num_seqs=4))
    w = make_worker(r, redis_url, engine=engine, max_num_seqs=4, bulk_flush_lines=5)
    w.run(burst=True)

    assert sorted(engine.added) == sorted(f"{live}-L{i}" for i in range(1, n + 1))  # nothing of the dead bulk ran
    assert r.xpending(keys.jobs_stream("low"), "workers")["pending"] == 0  # ...and all of it is acked
    assert r.xlen(keys.dead_letter_stream()) == 0  # a cancelled bulk's jobs are not dead letters
    res = producer.result(f"{dead}-L1", timeout=1)
    assert res.status == JobStatus.CANCELLED and dead in res.error and res.token_ids == []
    assert not r.exists(keys.job_hash(hashless.job_id))  # no hash was there, none is made up
    # the cancelling bulk's orchestrator sees every job accounted for (skipped), the live bulk completes
    assert r.hget(keys.bulk_hash(dead), "skipped") == str(n + 1).encode()
    assert r.hget(keys.bulk_hash(dead), "completed") == b"0"
    assert r.hget(keys.bulk_hash(live), "completed") == str(n).encode()
    # liveness is cached per bulk: not one round trip per job
    assert w.bulk.gate.num_checks < n


def test_sink_that_cannot_write_stops_pulling_and_bounds_the_pel(r, redis_url, producer, tmp_path):
    from pagestream.producer.bulk.storage import StorageError
    from pagestream.worker.bulk_sink import BulkSink

    class FailingStorage:
        def __init__(self):
            self.attempts = 0

        def put_bytes(self, name, data):
            self.attempts += 1
            raise StorageError("503 Slow Down (injected)")

    bulk_id = _bulk(redis_url, tmp_path, "b-stuck")
    n = 200
    producer.submit_many([_bulk_job(bulk_id, i, tmp_path) for i in range(1, n + 1)])
    engine = _CountingEngine(FakeConfig(max_num_seqs=4))
    w = make_worker(r, redis_url, engine=engine, max_num_seqs=4, prefetch=2,
                    bulk_flush_lines=4, bulk_flush_interval_s=0.05, bulk_max_buffered_lines=12)
    storage = FailingStorage()
    w.bulk.sink = BulkSink(r, w.name, w.settings)
    w.bulk.sink._storages[str(tmp_path / bulk_id)] = storage
    stream = keys.jobs_stream("low")
    bound = 12 + 4 + 2  # buffered results + admission limit + prefetch
    try:
        for _ in range(300):
            if w.bulk.backpressure and not w._busy():
                break
            w.run(max_steps=1)
            assert r.xpending(stream, "workers")["pending"] <= bound
        assert w.bulk.backpressure and storage.attempts >= 1
        # stalled: a few more iterations neither pull nor admit, but flushes are retried
        taken = len(engine.added)
        tries = storage.attempts
        deadline = time.monotonic() + 10
        while storage.attempts == tries and time.monotonic() < deadline:
            w._iteration(block=False)
        assert storage.attempts > tries and len(engine.added) == taken
    finally:
        w.close()
    pending = r.xpending(stream, "workers")["pending"]
    assert 12 <= pending <= bound and len(engine.added) == pending < n  # nothing acked, nothing lost
    assert r.hget(keys.bulk_hash(bulk_id), "completed") == b"0"

    # once parts can be written again, a restart under the same name finishes the lot (the
    # entries beyond what it recovers at start come back when their lease lapses)
    w2 = make_worker(r, redis_url, max_num_seqs=4, prefetch=2, bulk_flush_lines=4, bulk_max_buffered_lines=12,
                     lease_ms=100, reclaim_interval_s=0.01)
    time.sleep(0.2)
    w2.run(burst=True)
    assert r.xpending(stream, "workers")["pending"] == 0
    assert r.hget(keys.bulk_hash(bulk_id), "completed") == str(n).encode()


def test_a_burst_reaches_the_engine_in_chunks_before_it_is_all_checked(r, redis_url, producer, monkeypatch):
    # 100 jobs queued before the worker reads: the engine gets the first ones after at most one
    # chunk of entries was parsed, not after all 100 (a burst's first jobs start sooner)
    from pagestream.worker import intake

    parsed = []
    real_parse = intake.parse_delivery
    monkeypatch.setattr(intake, "parse_delivery", lambda d, n: parsed.append(d) or real_parse(d, n))
    w = make_worker(r, redis_url, max_num_seqs=128, prefetch=0)
    parsed_at_add: list[int] = []
    real_add = w.engine.add_request
    w.engine.add_request = lambda *a, **k: parsed_at_add.append(len(parsed)) or real_add(*a, **k)
    ids = producer.submit_many([{"prompt": f"job {i}", "max_tokens": 3, "seed": i} for i in range(100)])
    w.run(burst=True)
    assert all(res.status == JobStatus.COMPLETED for res in producer.results(ids, timeout=5))
    assert len(parsed_at_add) == 100
    assert parsed_at_add[0] <= intake.ACCEPT_CHUNK < 100, parsed_at_add[:3]


def _histogram(registry, name: str) -> dict[str, float]:
    """A histogram's ``_count``, ``_sum`` and buckets (by ``le``) as /metrics shows them, with its labels."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"labels": set()}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name == f"{name}_count":
                out["count"], out["labels"] = s.value, out["labels"] | {tuple(sorted(s.labels.items()))}
            elif s.name == f"{name}_sum":
                out["sum"] = s.value
            elif s.name == f"{name}_bucket":
                out.setdefault("le", []).append(s.labels["le"])
    return out


def test_iteration_tokens_histogram_counts_each_engine_step_and_its_tokens(r, redis_url, producer):
    """vLLM's ``vllm:iteration_tokens_total`` on the worker's /metrics: one observation per engine step, the tokens
    it computed (a request's prompt on its first step, then one per decoding sample), vLLM's buckets, model_name."""
    w = make_worker(r, redis_url, max_num_seqs=4, prefetch=0, served_model_name="m-iter")
    prompts = [("one two three", 4), ("four five", 6), ("six seven eight nine", 3)]
    jobs = [producer.submit(prompt=p, max_tokens=m, seed=1, model="m-iter", queue_unserved=True) for p, m in prompts]
    w.run(burst=True)
    for j in jobs:
        assert producer.result(j, timeout=2).status == JobStatus.COMPLETED
    hist = _histogram(w.metrics.registry, "vllm:iteration_tokens_total")  # vLLM's name: a histogram's, _total and all
    assert hist["labels"] == {(("model_name", "m-iter"),)}
    # each step computes something here, so the histogram's count is the worker's steps
    assert hist["count"] == w.num_steps > 0
    # each prompt once (its first step: the fake tokenizer's words) and each later token of each job once
    assert hist["sum"] == sum(len(p.split()) + m - 1 for p, m in prompts)
    assert hist["le"] == ["1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "1024.0", "2048.0", "4096.0",
                          "8192.0", "16384.0", "+Inf"]
