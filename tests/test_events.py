"""The job-event firehose ``ps:events`` (issue 27) against a real Redis, with the fake engine:
each lifecycle change writes its event in the same script / transaction as the change itself."""
from __future__ import annotations

import pytest

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.events import EventType, events_maxlen
from pagestream.producer.protocol.schema import JobStatus
from tests.queue_helpers import WorkerProc, wait_for


@pytest.fixture
def workers(tmp_path):
    started: list[WorkerProc] = []

    def start(*a, **kw) -> WorkerProc:
        w = WorkerProc(*a, log_dir=tmp_path, **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop(timeout=10)


def test_a_job_that_runs_reports_queued_started_first_token_finished_in_order(r, redis_url, producer, workers):
    w = workers(redis_url, "fake:1", "ev-a")
    w.wait_ready(60)
    other = producer.submit(prompt="someone else", max_tokens=3, seed=1)
    job = producer.submit(prompt="hello events", max_tokens=5, seed=7)
    seen = []
    for ev in producer.events(job=job, follow=True, block_s=0.2):  # from the oldest event kept
        seen.append(ev)
        if ev.type == EventType.FINISHED:
            break
    assert [e.type for e in seen] == [EventType.QUEUED, EventType.STARTED, EventType.FIRST_TOKEN, EventType.FINISHED]
    assert {e.job for e in seen} == {job}
    assert [e.id for e in seen] == sorted([e.id for e in seen], key=lambda i: tuple(map(int, i.split("-"))))
    queued, started, first, finished = seen
    assert queued.fields["lane"] == "normal" and queued.fields["model"] == ""  # no model asked: any worker
    assert started.fields["worker"] == "ev-a" and started.fields["deliveries"] == "1"
    res = producer.result(job, timeout=30)
    assert finished.fields["worker"] == "ev-a"
    assert finished.fields["tokens"] == str(res.completion_tokens) == "5"
    assert finished.fields["finish_reason"] == res.finish_reason
    assert float(finished.fields["run_s"]) >= 0 and float(finished.fields["queue_s"]) >= 0
    # the first token: after the start, before the end; its latency counts from the submit, within the job's whole time
    assert first.fields["worker"] == "ev-a" and started.ts <= first.ts <= finished.ts
    ttft, total = float(first.fields["ttft_s"]), float(finished.fields["queue_s"]) + float(finished.fields["run_s"])
    assert 0 < ttft <= total + 1e-5, (ttft, total)
    assert ttft >= float(finished.fields["queue_s"]) - 1e-5  # it waited in the queue before its first token
    assert abs(first.ts - ttft - res.created_at) < 1e-3  # ts minus ttft: the submit time
    # the other job's events are there too, unfiltered; a type filter keeps only that type
    producer.result(other, timeout=30)
    assert {e.job for e in producer.events()} == {job, other}
    assert [e.job for e in producer.events(types=["finished"])].count(job) == 1
    assert [e.job for e in producer.events(types=["first_token"])].count(job) == 1  # one per job, not one per token


@pytest.mark.also_on_cluster  # there the events stream is a slot of its own, written just after the change
def test_cancel_while_queued_reports_cancelled_and_from_now_skips_the_past(r, producer):
    job = producer.submit(prompt="never runs", max_tokens=5, lane="high")
    assert producer.cancel(job) == JobStatus.QUEUED
    assert [e.type for e in producer.events(job=job)] == [EventType.QUEUED, EventType.CANCELLED]
    assert [e.fields["lane"] for e in producer.events(job=job)] == ["high", "high"]
    assert producer.cancel(job) == JobStatus.CANCELLED  # a second cancel changes nothing: no second event
    assert [e.type for e in producer.events(job=job)] == [EventType.QUEUED, EventType.CANCELLED]
    # a submit repeated under the same id queues nothing and reports nothing
    again = producer.submit(prompt="never runs", max_tokens=5, lane="high", job_id=job)
    assert again == job and [e.type for e in producer.events(job=job)] == [EventType.QUEUED, EventType.CANCELLED]
    many = producer.submit_many([{"prompt": f"m{i}", "max_tokens": 1, "model": "m"} for i in range(5)],
                                queue_unserved=True)
    queued = [e for e in producer.events(types=["queued"]) if e.job in many]
    assert [e.job for e in queued] == many and {e.fields["model"] for e in queued} == {"m"}
    assert list(producer.events(from_id="$")) == []
    last = list(producer.events())[-1].id
    later = producer.submit(prompt="later", max_tokens=1)
    assert [(e.job, e.type) for e in producer.events(from_id=last)] == [(later, EventType.QUEUED)]


def test_an_unknown_event_type_is_refused_before_any_read(producer):
    with pytest.raises(ValueError):
        list(producer.events(types=["finishd"]))


def test_the_stream_stays_under_its_bound(r, producer, monkeypatch):
    monkeypatch.setenv("PAGESTREAM_EVENTS_MAXLEN", "100")
    events_maxlen.cache_clear()
    try:
        ids = producer.submit_many([{"prompt": f"p{i}", "max_tokens": 1} for i in range(1500)])
        for j in ids[:300]:
            producer.cancel(j)
    finally:
        monkeypatch.delenv("PAGESTREAM_EVENTS_MAXLEN")
        events_maxlen.cache_clear()
    n = r.xlen(keys.events_stream())
    assert 100 <= n < 300, n  # MAXLEN ~ trims whole nodes: a little over the bound, never unbounded
    newest = [e.job for e in producer.events()][-1]
    assert newest == ids[299]  # the newest event (the last cancel) is kept


@pytest.mark.also_on_cluster
def test_the_async_producer_reads_the_same_events(redis_url, producer):
    import asyncio

    from pagestream.producer import AsyncProducer

    job = producer.submit(prompt="async reader", max_tokens=2)
    producer.cancel(job)

    async def read() -> list:
        async with AsyncProducer.from_url(redis_url) as ap:
            return [(e.job, e.type) async for e in ap.events(job=job)]

    assert asyncio.run(read()) == [(job, EventType.QUEUED), (job, EventType.CANCELLED)]


def test_cancel_while_running_reports_cancelled_from_the_worker(r, redis_url, producer, workers):
    w = workers(redis_url, "fake:40", "ev-run")
    w.wait_ready(60)
    job = producer.submit(prompt="long one", max_tokens=500, seed=3)
    seen = []
    for ev in producer.events(job=job, follow=True, block_s=0.2):
        seen.append(ev.type)
        if ev.type == EventType.STARTED:
            assert producer.cancel(job) == JobStatus.RUNNING
        if ev.type in (EventType.CANCELLED, EventType.FINISHED, EventType.FAILED):
            break
    res = producer.result(job, timeout=30)
    assert res.status == JobStatus.CANCELLED
    # a first token only if one was made before the cancel landed (then between the start and the end)
    first = [EventType.FIRST_TOKEN] if res.completion_tokens else []
    assert seen == [EventType.QUEUED, EventType.STARTED, *first, EventType.CANCELLED], (seen, res.completion_tokens)


def test_a_poison_entry_is_reported_dead_lettered(r, redis_url, producer, workers):
    from pagestream.producer.protocol.wire import JOB_FIELD

    w = workers(redis_url, "fake:1", "ev-dlq")
    w.wait_ready(60)
    r.xadd(keys.jobs_stream("normal", None), {JOB_FIELD: "{not json"})
    for ev in producer.events(follow=True, block_s=0.2, types=["dead_lettered"]):
        break
    assert ev.job == "" and ev.fields["lane"] == "normal"  # the entry named no job
    assert ev.fields["error"]


def test_a_job_that_fails_reports_failed_with_its_error_then_dead_lettered(r, redis_url, producer, workers):
    import json
    import time

    from pagestream.producer.protocol.wire import JOB_FIELD

    w = workers(redis_url, "fake:1", "ev-fail")
    w.wait_ready(60)
    # a raw entry that names its job but asks for what no job may (the worker fails it, with the reason)
    r.xadd(keys.jobs_stream("normal", None), {JOB_FIELD: json.dumps({"job_id": "ev-bad", "prompt": "x", "max_tokens": -1})})
    deadline = time.monotonic() + 30
    seen = []
    for ev in producer.events(job="ev-bad", follow=True, block_s=0.2, stop=lambda: time.monotonic() > deadline):
        seen.append(ev)
        if ev.type == EventType.DEAD_LETTERED:
            break
    assert [e.type for e in seen] == [EventType.FAILED, EventType.DEAD_LETTERED], seen
    assert "max_tokens" in seen[0].fields["error"] and seen[0].fields["error"] == seen[1].fields["error"]
    assert producer.result("ev-bad", timeout=5).status == JobStatus.FAILED


def test_kill9_mid_job_reports_reclaimed_started_resumed_then_finished(r, redis_url, producer, workers):
    a = workers(redis_url, "fake:20", "ev-kill-a", "--lease-ms", "1000")
    a.wait_ready(60)
    job = producer.submit(prompt="taken over", max_tokens=150, seed=5)  # ~3 s of 20 ms steps
    wait_for(lambda: r.xlen(keys.out_stream(job)) >= 2, 30, "the job's first tokens")
    a.kill9()
    workers(redis_url, "fake:1", "ev-kill-b", "--lease-ms", "1000")  # reclaims once the dead one's lease lapsed
    res = producer.result(job, timeout=60)
    assert res.status == JobStatus.COMPLETED and res.worker == "ev-kill-b" and res.resumed_from > 0
    evs = list(producer.events(job=job))
    assert [e.type for e in evs] == [EventType.QUEUED, EventType.STARTED, EventType.FIRST_TOKEN, EventType.RECLAIMED,
                                     EventType.STARTED, EventType.RESUMED, EventType.FINISHED]
    _, started_a, first, reclaimed, started_b, resumed, finished = evs
    assert started_a.fields["worker"] == first.fields["worker"] == "ev-kill-a"
    assert reclaimed.fields["worker"] == "ev-kill-b" and reclaimed.fields["from_worker"] == "ev-kill-a"
    assert reclaimed.fields["deliveries"] == started_b.fields["deliveries"] == "2" and started_b.fields["worker"] == "ev-kill-b"
    # it continues from what the dead worker published: that many tokens, as the result says
    assert resumed.fields["worker"] == "ev-kill-b" and resumed.fields["tokens"] == str(res.resumed_from)
    assert finished.fields["worker"] == "ev-kill-b" and finished.fields["deliveries"] == "2"
    assert reclaimed.ts == started_b.ts == resumed.ts  # written with the start of the delivery that took it over


def test_a_small_bulk_reports_monotone_progress_per_part_then_one_bulk_finished(redis_url, producer, tmp_path):
    from pagestream.producer.bulk.api import submit_bulk
    from pagestream.producer.protocol.bulk import BulkSpec
    from test_bulk import run_bulk_with_standins, write_input

    assert BulkSpec(bulk_id="b1", input="i", output="o").batch_id is None
    inp = tmp_path / "in.jsonl"
    write_input(inp, 20, bad_every=7)  # lines 7 and 14 are invalid
    # a Batch API batch (it has an input file): its events name the batch too
    bulk_id = submit_bulk(str(inp), str(tmp_path / "out"), redis_url=redis_url, bulk_id="batch_ev1", input_file_id="file-ev1")
    st = run_bulk_with_standins(redis_url, bulk_id, n_workers=1, count=4, flush_lines=4)  # parts of 4 lines
    assert st["status"] == "completed" and st["request_counts"] == {"total": 20, "completed": 18, "failed": 2}
    evs = [e for e in producer.events() if e.fields.get("bulk") == bulk_id]
    progress = [e for e in evs if e.type == EventType.BULK_PROGRESS]
    assert [e.type for e in evs] == [EventType.BULK_PROGRESS] * len(progress) + [EventType.BULK_FINISHED]
    # one per committed part: the feed's part of invalid lines, then the 18 answered lines' parts of at most 4
    assert 1 + 5 <= len(progress) <= 1 + 18 // 2, [e.fields for e in progress]
    done, failed, total = ([int(e.fields[k]) for e in progress] for k in ("done", "failed", "total"))
    assert all(x < y for x, y in zip(done, done[1:])), done  # each part moved it on
    assert failed == sorted(failed) and total == sorted(total) and all(d <= t for d, t in zip(done, total))
    assert (done[-1], failed[-1], total[-1]) == (20, 2, 20)
    assert all(e.job == "" and e.fields["batch"] == bulk_id for e in evs)
    fin = evs[-1].fields
    assert (fin["status"], fin["done"], fin["failed"], fin["total"]) == ("completed", "20", "2", "20")
