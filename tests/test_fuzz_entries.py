"""Property suite over raw lane entries (issue 8): whatever a raw XADD puts on a lane, a real
worker settles it with a clear failed result or a correct one, and a good neighbour job
running beside it comes out exact.

Each hypothesis example queues a batch of generated entries and one neighbour job, runs a
real ``Worker`` (the instant fake engine) against the real Redis in burst mode, and checks:

- every entry is settled: nothing pending, nothing left in the worker;
- an entry built valid completes with exactly the fake engine's text (a correct result);
- an entry built broken (lone surrogate, nesting past the limit, oversized, NaN, wrong
  type, unknown field, wrong lane, cut short) ends FAILED with a reason, reaches the DLQ,
  and, since it names its job, the producer can read that result;
- random entries (random field maps, random bytes, random JSON with surrogates and
  NaN) each end in the DLQ or, if they happen to be a valid job, complete;
- the neighbour completes exactly, on its first delivery.

CI size: ``PAGESTREAM_FUZZ_EXAMPLES`` examples (default 100, about 2,500 entries in
all, derandomized so every run checks the same inputs). Nightly size: set
``PAGESTREAM_FUZZ_EXAMPLES=2000`` (about 50,000 entries) and, to explore new inputs
instead of the fixed ones, ``PAGESTREAM_FUZZ_RANDOM=1``.
"""
from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagestream.producer import JobStatus, Producer
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.schema import JobRequest, JobResult
from pagestream.worker.fake_engine import FakeConfig, FakeEngine
from pagestream.worker.settings import WorkerSettings
from pagestream.worker.worker import Worker

LANE = keys.jobs_stream("normal")
MAX_ENTRY_BYTES = 16 * 1024  # small, so "oversized" entries stay cheap to generate
EXAMPLES = int(os.environ.get("PAGESTREAM_FUZZ_EXAMPLES", "100"))
RANDOM = os.environ.get("PAGESTREAM_FUZZ_RANDOM") == "1"


@dataclass
class Case:
    fields: dict[bytes, bytes]
    kind: str  # "good", "bad" (broken by construction) or "random" (either outcome is right if settled)
    job_id: str | None = None
    prompt: str = ""
    seed: int = 0
    max_tokens: int = 0


# -- strategies -----------------------------------------------------------------------------

words = st.text(alphabet=string.ascii_letters + string.digits + "éüßλ中文🙂.,!?-", min_size=1, max_size=8)
prompts = st.lists(words, min_size=1, max_size=6).map(" ".join)
any_text = st.text(alphabet=st.characters(codec=None), max_size=20)  # surrogates included
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
safe_json = st.recursive(  # what a well-behaved producer might put in metadata
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False) | words,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(words, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def good_spec(draw, n: int) -> dict:
    return {
        "job_id": f"fz-{n}-{draw(st.integers(0, 10**9))}",
        "prompt": draw(prompts),
        "max_tokens": draw(st.integers(1, 8)),
        "seed": draw(st.integers(0, 2**31)),
        "metadata": draw(st.dictionaries(words, safe_json, max_size=3)),
    }


def _good(spec: dict) -> Case:
    raw = json.dumps(spec, ensure_ascii=draw_ascii(spec)).encode()
    return Case({b"job": raw}, "good", spec["job_id"], spec["prompt"], spec["seed"], spec["max_tokens"])


def draw_ascii(spec: dict) -> bool:
    return len(spec["prompt"]) % 2 == 0  # both escapes and raw UTF-8 reach the worker


def _inject(spec: dict, text: str) -> bytes:
    """The spec's JSON with ``text`` (raw JSON) spliced in as the metadata value of key "x"."""
    head = json.dumps({k: v for k, v in spec.items() if k != "metadata"})[:-1]
    return (head + ', "metadata": {"x": ' + text + "}}").encode()


BREAKERS = {
    "lone surrogate": lambda d: '"' + d(st.sampled_from(["\\ud800", "\\udfff", "a\\udc00b", "\\ud83c"])) + '"',
    "nested deeper": lambda d: (lambda k: "[" * k + "]" * k)(d(st.integers(40, 50_000))),
    "bytes": lambda d: '"' + "y" * d(st.integers(MAX_ENTRY_BYTES, 3 * MAX_ENTRY_BYTES)) + '"',
    "NaN": lambda d: d(st.sampled_from(["NaN", "Infinity", "-Infinity"])),
    "out of range": lambda d: d(st.sampled_from(["1e400", "-1e999"])),
}


@st.composite
def bad_case(draw, n: int) -> Case:
    spec = draw(good_spec(n))
    how = draw(st.sampled_from([*BREAKERS, "wrong type", "unknown field", "wrong lane", "cut short", "not an object"]))
    if how in BREAKERS:
        raw = _inject(spec, BREAKERS[how](draw))
    elif how == "wrong type":
        field = draw(st.sampled_from(["max_tokens", "prompt", "seed", "metadata", "temperature", "priority"]))
        spec[field] = draw(st.sampled_from([[1], {"a": 1}, "many", -5.5, True]) .filter(lambda v: not _fits(field, v)))
        raw = json.dumps(spec).encode()
    elif how == "unknown field":
        spec[draw(st.sampled_from(["tempreature", "__proto__", "eval", "x" * 40]))] = draw(safe_json)
        raw = json.dumps(spec).encode()
    elif how == "wrong lane":
        spec["lane"] = draw(st.sampled_from(["high", "low", "warp", ""]))
        raw = json.dumps(spec).encode()
    elif how == "not an object":
        return Case({b"job": json.dumps([spec]).encode()}, "random")  # names no job at top level
    else:
        full = json.dumps(spec).encode()
        raw = full[: draw(st.integers(len(full) // 2, len(full) - 1))]
    return Case({b"job": raw}, "bad", spec["job_id"])


def _fits(field: str, v: object) -> bool:
    """True when pydantic (lax) would accept ``v`` for ``field``: such a draw is not a broken job."""
    try:
        JobRequest.model_validate({"prompt": "p", field: v} if field != "prompt" else {"prompt": v})
        return True
    except ValueError:
        return False


random_fields = st.dictionaries(
    st.binary(min_size=1, max_size=12) | st.just(b"job"), st.binary(max_size=64), min_size=1, max_size=4
)
random_json_entry = json_values.map(lambda v: {b"job": json.dumps(v).encode()})  # json.dumps writes NaN, \ud800
random_job_dict = st.dictionaries(
    st.sampled_from(["job_id", "prompt", "max_tokens", "messages", "lane", "output", "metadata", "n", "stop", "ttl_s"]),
    json_values, max_size=5,
).map(lambda v: {b"job": json.dumps(v).encode()})


@st.composite
def cases(draw) -> list[Case]:
    out = []
    for n in range(draw(st.integers(10, 40))):
        kind = draw(st.sampled_from(["good", "bad", "bad", "random"]))
        if kind == "good":
            out.append(_good(draw(good_spec(n))))
        elif kind == "bad":
            out.append(draw(bad_case(n)))
        else:
            out.append(Case(draw(st.one_of(random_fields, random_json_entry, random_job_dict)), "random"))
    return out


# -- the property ---------------------------------------------------------------------------


def _check(r: redis.Redis, url: str, batch: list[Case]) -> None:
    r.flushdb()
    engine = FakeEngine(FakeConfig(max_num_seqs=8))
    # lease_ms: the control thread blocks in XREAD for a third of the lease (up to 0.5 s), and closing the Worker
    # of each example joins it: 150 ms waits 50 ms at most there (no reclaim runs, so no lease lapses)
    w = Worker(r, engine, WorkerSettings(
        redis_url=url, consumer="fuzz", publish_interval_ms=1, lease_ms=150, reclaim_interval_s=3600, max_entry_bytes=MAX_ENTRY_BYTES,
        dead_letter_payload_bytes=1024, max_deliveries=3,
    ))
    with Producer.from_url(url) as p:
        mid = len(batch) // 2
        for c in batch[:mid]:
            r.xadd(LANE, c.fields)
        neighbour = p.submit(prompt="the good neighbour", max_tokens=12, seed=7)
        for c in batch[mid:]:
            r.xadd(LANE, c.fields)
        w.run(burst=True)

        res = p.result(neighbour, timeout=10)
        assert res.status == JobStatus.COMPLETED and res.deliveries == 1
        assert res.text == engine.expected_text("the good neighbour", seed=7, max_tokens=12)
    assert r.xpending(LANE, "workers")["pending"] == 0
    assert not w.jobs and w.state.num_held() == 0

    dead = [json.loads(f[b"meta"]) for _, f in r.xrange(keys.dead_letter_stream())]
    dead_ids = [d["job_id"] for d in dead]
    assert all(d["reason"] for d in dead)
    for c in batch:
        raw = r.hget(keys.job_hash(c.job_id), "result") if c.job_id else None
        if c.kind == "good":
            got = JobResult.model_validate_json(raw)
            assert got.status == JobStatus.COMPLETED, (c, got.error)
            assert got.text == engine.expected_text(c.prompt, seed=c.seed, max_tokens=c.max_tokens)
        elif c.kind == "bad":
            assert raw is not None, c
            got = JobResult.model_validate_json(raw)
            assert got.status == JobStatus.FAILED and got.error, (c, got)
            assert c.job_id in dead_ids
    # a random entry is a dead letter, or by chance a job that ran (or was skipped as a duplicate)
    n_bad = sum(c.kind == "bad" for c in batch)
    assert n_bad <= len(dead) <= n_bad + sum(c.kind == "random" for c in batch)


def test_raw_lane_entries_get_a_clear_failure_or_a_correct_result(redis_url):
    r = redis.Redis.from_url(redis_url)
    seen = {"entries": 0}

    @settings(max_examples=EXAMPLES, derandomize=not RANDOM, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(batch=cases())
    def prop(batch: list[Case]) -> None:
        seen["entries"] += len(batch)
        _check(r, redis_url, batch)

    prop()
    # ~25 a batch (10-40): about 2,500 inputs at the CI size; a floor below the mean, because the count moved by a few
    # entries between a serial and an xdist run (1,999 once), and the property, not the count, is what is tested
    assert seen["entries"] >= 15 * EXAMPLES
