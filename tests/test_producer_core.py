"""One producer core for Producer and AsyncProducer: same API and errors, model routing at submit,
and subscribers that ride out a Redis restart (a redis-server of the test's own, restarted mid-stream)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from pagestream.producer import AsyncProducer, JobStatus, ModelNotServed, Producer
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.job import CANCEL_LUA, SUBMIT_LUA
from pagestream.producer.protocol.wire import end_fields, token_event_fields
from private_redis import PrivateRedis


def _announce(r: redis.Redis, model: str, ttl_s: float = 30.0) -> None:
    r.zadd(keys.model_registry(), {model: int((time.time() + ttl_s) * 1000)})


def _publish(r: redis.Redis, job_id: str, start: int, stop: int, total: int) -> None:
    for i in range(start, stop):
        finish = "length" if i == total - 1 else None
        r.xadd(keys.out_stream(job_id), token_event_fields(0, i, [100 + i], f"t{i} ", finish))
    if stop == total:
        r.xadd(keys.out_stream(job_id), end_fields("completed"))


def test_lua_scripts_are_built_from_the_wire_constants():
    for status in ("queued", "completed", "failed", "cancelled", "expired"):
        assert f"'{status}'" in CANCEL_LUA
    assert "'job'" in SUBMIT_LUA and "'end'" in CANCEL_LUA


def test_sync_and_async_share_api_errors_and_context_managers(redis_url, r):
    sync_api = {n for n in dir(Producer) if not n.startswith("_")} - {"close"}
    async_api = {n for n in dir(AsyncProducer) if not n.startswith("_")} - {"aclose"}
    assert sync_api == async_api

    with Producer.from_url(redis_url) as p:
        with pytest.raises(TimeoutError):
            p.result(p.submit(prompt="never served", job_id="s1"), timeout=0.2)
        pipe = r.pipeline()
        p.submit(prompt="piped", job_id="s2", pipeline=pipe)
        assert p.status("s2") is None  # queued on the pipeline only
        pipe.execute()
        assert p.status("s2") == JobStatus.QUEUED

    async def main():
        async with AsyncProducer.from_url(redis_url) as ap:
            with pytest.raises(TimeoutError):  # the same exception type as the sync side
                await ap.result(await ap.submit(prompt="never served", job_id="a1"), timeout=0.2)
            pipe = ap.redis.pipeline()
            await ap.submit(prompt="piped", job_id="a2", pipeline=pipe)
            assert await ap.status("a2") is None
            await pipe.execute()
            assert await ap.status("a2") == JobStatus.QUEUED
            assert await ap.cancel("a2") == JobStatus.QUEUED
            assert (await ap.result("a2", timeout=5)).status == JobStatus.CANCELLED

    asyncio.run(main())


def test_submit_refuses_a_model_no_worker_serves_unless_asked_to_queue(producer, r):
    with pytest.raises(ModelNotServed, match="no worker serves model 'llama-70b'"):
        producer.submit(prompt="hi", model="llama-70b")
    assert r.xlen(keys.jobs_stream("normal", "llama-70b")) == 0
    jid = producer.submit(prompt="hi", model="llama-70b", queue_unserved=True)
    assert r.xlen(keys.jobs_stream("normal", "llama-70b")) == 1
    assert producer.status(jid) == JobStatus.QUEUED

    _announce(r, "smol")
    jid = producer.submit(prompt="hi", model="smol", lane="high")
    assert r.xlen(keys.jobs_stream("high", "smol")) == 1 and r.xlen(keys.jobs_stream("high")) == 0
    assert producer.live_models() == ["smol"]
    _announce(r, "gone", ttl_s=-1)  # an announcement that expired
    with pytest.raises(ModelNotServed):
        producer.submit_many([{"prompt": "a", "model": "smol"}, {"prompt": "b", "model": "gone"}])
    assert r.xlen(keys.jobs_stream("normal", "smol")) == 0  # nothing of a refused batch is queued


def _restart_midstream(server: PrivateRedis, job_id: str, published: threading.Event) -> None:
    time.sleep(0.5)  # the subscriber is blocked in XREAD now
    server.restart(down_s=2.0)
    r = redis.Redis.from_url(server.url)
    _publish(r, job_id, 3, 6, total=6)
    published.set()


def test_sync_stream_resumes_after_a_redis_restart():
    server = PrivateRedis()
    try:
        with Producer.from_url(server.url) as p:
            jid = p.submit(prompt="hello", max_tokens=6)
            _publish(redis.Redis.from_url(server.url), jid, 0, 3, total=6)
            events = p.stream(jid, timeout=60)
            got = [next(events) for _ in range(3)]
            published = threading.Event()
            t = threading.Thread(target=_restart_midstream, args=(server, jid, published))
            t.start()
            got += list(events)
            t.join()
            assert published.is_set()
            assert [e.index for e in got] == [0, 1, 2, 3, 4, 5]
            assert "".join(e.text for e in got) == "t0 t1 t2 t3 t4 t5 "
            assert got[-1].finish_reason == "length"
    finally:
        server.stop()


def test_async_stream_resumes_after_a_redis_restart():
    server = PrivateRedis()

    async def main():
        async with AsyncProducer.from_url(server.url) as p:
            jid = await p.submit(prompt="hello", max_tokens=6)
            _publish(redis.Redis.from_url(server.url), jid, 0, 3, total=6)
            events = p.stream(jid, timeout=60)
            got = [await anext(events) for _ in range(3)]
            published = threading.Event()
            restart = asyncio.create_task(asyncio.to_thread(_restart_midstream, server, jid, published))
            got += [e async for e in events]
            await restart
            return got

    try:
        got = asyncio.run(main())
        assert [e.index for e in got] == [0, 1, 2, 3, 4, 5]
        assert "".join(e.text for e in got) == "t0 t1 t2 t3 t4 t5 "
    finally:
        server.stop()
