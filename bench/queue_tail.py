"""The end of a queue-fed burst, off the GPU: N finished jobs of T tokens written by the worker's
publisher, and read back by another process (as the throughput bench's client does).

    .venv/bin/python bench/queue_tail.py [--jobs 256] [--tokens 256] [--reader batch|threads] [--rounds 3]

Needs a Redis at --redis-url (its database is flushed). Prints, per round: building the results
(`results.job_result` on the loop thread), the publisher's flush of them, and when the reader had them
all, from the start of the build. ``--reader batch`` waits with ``Producer.results``; ``threads`` with
8 threads of ``Producer.result``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time
from concurrent.futures import ThreadPoolExecutor

import redis

from pagestream.producer import Producer
from pagestream.producer.protocol.schema import JobStatus
from pagestream.worker.consumer import Consumer
from pagestream.worker.jobs import ActiveJob, SampleOutput, parse_delivery
from pagestream.worker.publisher import Final, Publisher, Start
from pagestream.worker.results import job_result
from pagestream.worker.settings import WorkerSettings


def _reader(url: str, ids: list[str], reader: str, tokens: int, q) -> None:
    with Producer.from_url(url) as p:
        q.put("ready")
        if reader == "batch":
            got = p.results(ids, timeout=60)
        else:
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda j: p.result(j, timeout=60), ids))
        assert len(got) == len(ids) and all(len(r.token_ids) == tokens for r in got)
        q.put(time.time())


def one_round(url: str, jobs: int, tokens: int, reader: str) -> tuple[float, float, float]:
    r = redis.Redis.from_url(url)
    r.flushdb()
    with Producer.from_url(url) as p:
        ids = p.submit_many([{"prompt_token_ids": [5] * 16, "max_tokens": tokens, "temperature": 0.0,
                              "ignore_eos": True} for _ in range(jobs)])
    settings = WorkerSettings(redis_url=url, consumer="tail", model="m")
    consumer = Consumer(r, settings)
    deliveries = []
    while len(deliveries) < jobs:
        deliveries += consumer.read(jobs)
    pub = Publisher(r, consumer)
    pub.start()
    rng = random.Random(0)
    active = []
    for d in deliveries:
        a = ActiveJob(d, parse_delivery(d, settings.max_entry_bytes), started_at=time.time())
        a.samples[0] = SampleOutput(token_ids=[rng.randrange(1000, 30000) for _ in range(tokens)],
                                    text=["tok "] * tokens, finish_reason="length")
        active.append(a)
    pub.put([Start(a.job_id, "tail", a.started_at, 1) for a in active])
    pub.flush()
    q = mp.Queue()
    proc = mp.Process(target=_reader, args=(url, ids, reader, tokens, q))
    proc.start()
    q.get()
    time.sleep(1.0)  # the reader is blocked on the jobs' streams
    t0 = time.time()
    finals = []
    for a in active:
        res = job_result(a, JobStatus.COMPLETED, None, "tail")
        finals.append(Final(res, 3600, (a.delivery.lane, a.delivery.entry_id)))
    t1 = time.time()
    pub.put(finals)
    pub.flush()
    t2 = time.time()
    done = q.get()
    proc.join()
    pub.stop()
    return t1 - t0, t2 - t1, done - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    ap.add_argument("--jobs", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reader", default="batch", choices=("batch", "threads"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    try:
        import hiredis  # noqa: F401
        parser = "hiredis"
    except ImportError:
        parser = "redis-py's Python parser"
    print(f"{args.jobs} jobs x {args.tokens} tokens, reader {args.reader}, {parser}")
    for _ in range(args.rounds):
        build, flush, read = one_round(args.redis_url, args.jobs, args.tokens, args.reader)
        print(f"build results {1e3 * build:.1f} ms, publisher flush {1e3 * flush:.1f} ms, "
              f"all read {1e3 * read:.1f} ms after the build started")


if __name__ == "__main__":
    main()
