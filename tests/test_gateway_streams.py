"""The gateway's shared stream reader (``AsyncProducer(multiplex_reads=True)``, producer.client.mux):
many jobs followed at once through one blocking XREAD, each subscriber getting exactly its own
events, a job that joins a blocked read served at once, and a Redis restart ridden out.
Events are published by hand here, as a worker would write them."""
from __future__ import annotations

import asyncio
import threading
import time

import redis

from pagestream.producer import AsyncProducer, JobStatus
from pagestream.producer.protocol import keys
from pagestream.producer.client import mux as client_mux
from pagestream.producer.protocol.wire import end_fields, token_event_fields
from private_redis import PrivateRedis


def _publish(r: redis.Redis, job_id: str, start: int, stop: int, total: int) -> None:
    for i in range(start, stop):
        finish = "length" if i == total - 1 else None
        r.xadd(keys.out_stream(job_id), token_event_fields(0, i, [100 + i], f"{job_id}:{i} ", finish))
    if stop == total:
        r.xadd(keys.out_stream(job_id), end_fields("completed"))


def test_many_followers_share_one_read_and_each_gets_exactly_its_events(redis_url, r):
    num_jobs, tokens = 60, 6

    async def main():
        async with AsyncProducer.from_url(redis_url, multiplex_reads=True) as p:
            jobs = [await p.submit(prompt=f"job {i}", max_tokens=tokens) for i in range(num_jobs)]

            async def follow(jid: str) -> tuple[str, list[int], JobStatus | None]:
                events = p.follow(jid, timeout=30)
                got = [ev async for ev in events]
                return "".join(e.text for e in got), [e.index for e in got], events.status

            def writer() -> None:  # a worker's flushes: one transaction per token across every job
                time.sleep(0.3)
                for i in range(tokens):
                    pipe = r.pipeline()
                    for jid in jobs:
                        _publish(pipe, jid, i, i + 1, tokens)
                    pipe.execute()
                    time.sleep(0.02)

            results = await asyncio.gather(*(follow(j) for j in jobs), asyncio.to_thread(writer))
            return jobs, results[:-1], p.mux.num_reads

    jobs, results, num_reads = asyncio.run(main())
    for jid, (text, indexes, status) in zip(jobs, results):
        assert text == "".join(f"{jid}:{i} " for i in range(tokens))
        assert indexes == list(range(tokens)) and status == JobStatus.COMPLETED
    # one XREAD serves every job a transaction wrote to, not one per job per wake (that was 60 x 7)
    assert num_reads < 60, num_reads


def test_a_job_that_joins_a_blocked_read_gets_its_first_event_at_once(redis_url, r, monkeypatch):
    monkeypatch.setattr(client_mux, "READ_BLOCK_MS", 20_000)  # without the ring, the second job would wait this long

    async def main():
        async with AsyncProducer.from_url(redis_url, multiplex_reads=True) as p:
            a, b = await p.submit(prompt="a", max_tokens=2), await p.submit(prompt="b", max_tokens=2)
            idle = asyncio.create_task(anext(p.stream(a, timeout=60)))
            await asyncio.sleep(0.3)  # the shared reader is blocked on job a alone
            _publish(r, b, 0, 2, total=2)
            t0 = time.monotonic()
            got = [ev async for ev in p.stream(b, timeout=60)]
            waited = time.monotonic() - t0
            _publish(r, a, 0, 2, total=2)
            first_a = await idle
            return got, waited, first_a

    got, waited, first_a = asyncio.run(main())
    assert [e.index for e in got] == [0, 1] and first_a.index == 0
    assert waited < 5.0, waited


def test_shared_reader_rides_out_a_redis_restart():
    server = PrivateRedis()

    async def main():
        async with AsyncProducer.from_url(server.url, multiplex_reads=True) as p:
            jid = await p.submit(prompt="hello", max_tokens=6)
            r = redis.Redis.from_url(server.url)
            _publish(r, jid, 0, 3, total=6)
            events = p.stream(jid, timeout=60)
            got = [await anext(events) for _ in range(3)]
            published = threading.Event()

            def restart() -> None:
                time.sleep(0.5)  # the shared reader is blocked in XREAD now
                server.restart(down_s=2.0)
                _publish(redis.Redis.from_url(server.url), jid, 3, 6, total=6)
                published.set()

            t = asyncio.create_task(asyncio.to_thread(restart))
            got += [e async for e in events]
            await t
            assert published.is_set()
            return got

    try:
        got = asyncio.run(main())
        assert [e.index for e in got] == [0, 1, 2, 3, 4, 5]
        assert "".join(e.text for e in got).split() == [f"{got[0].job_id}:{i}" for i in range(6)]
    finally:
        server.stop()


def test_a_follow_ends_with_the_summary_its_end_entry_carries_and_none_from_an_older_worker(redis_url, r):
    from pagestream.producer.protocol.schema import JobResult, SampleResult

    async def main():
        async with AsyncProducer.from_url(redis_url, multiplex_reads=True) as p:
            new, old = await p.submit(prompt="a", max_tokens=2), await p.submit(prompt="b", max_tokens=2)
            for jid in (new, old):
                for i in range(2):
                    r.xadd(keys.out_stream(jid), token_event_fields(0, i, [100 + i], "x", "length" if i else None))
            result = JobResult(job_id=new, status="completed", prompt_tokens=4, completion_tokens=2, started_at=1.0,
                               outputs=[SampleResult(index=0, text="xx", token_ids=[100, 101], finish_reason="length")])
            r.xadd(keys.out_stream(new), end_fields("completed", result))
            r.xadd(keys.out_stream(old), end_fields("completed"))  # as a worker before the summary writes it
            out = []
            for jid in (new, old):
                events = p.follow(jid, timeout=10)
                out.append(([ev.index async for ev in events], events.status, events.summary))
            return out

    (new_idx, new_st, new_sum), (old_idx, old_st, old_sum) = asyncio.run(main())
    assert new_idx == old_idx == [0, 1] and new_st == old_st == JobStatus.COMPLETED
    assert (new_sum.prompt_tokens, new_sum.completion_tokens, new_sum.started_at) == (4, 2, 1.0)
    assert new_sum.outputs[0].finish_reason == "length"
    assert old_sum is None
