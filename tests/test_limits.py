"""Size limits on a job (issue 8, item 7, schema side), against the real Redis.

``submit`` refuses an oversized job before anything reaches Redis, naming the field,
the limit and the setting that changes it; a worker refuses the same job written to a
lane stream by hand, with a failed result the producer can read; the limits come from
the environment (``PAGESTREAM_MAX_*``).
"""
from __future__ import annotations

import json

import pytest
import redis
from pydantic import ValidationError

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.limits import JobLimits, job_limits
from pagestream.producer.protocol.schema import JobRequest, JobStatus
from tests.queue_helpers import WorkerProc

DEFAULTS = JobLimits()

# (submit keywords, field named in the error, words the message must hold)
OVER_LIMIT = [
    (dict(prompt="x" * (DEFAULTS.max_prompt_bytes + 1)), "prompt", "PAGESTREAM_MAX_PROMPT_BYTES"),
    (dict(prompt="\u00e9" * (DEFAULTS.max_prompt_bytes // 2 + 1)), "prompt", "bytes"),  # bytes, not characters
    (dict(messages=[{"role": "user", "content": "y" * (DEFAULTS.max_prompt_bytes // 2 + 1)}] * 2), "messages",
     "PAGESTREAM_MAX_PROMPT_BYTES"),
    (dict(messages=[{"role": "user", "content": "a"}] * (DEFAULTS.max_messages + 1)), "messages",
     "PAGESTREAM_MAX_MESSAGES"),
    (dict(prompt_token_ids=[1] * (DEFAULTS.max_prompt_token_ids + 1)), "prompt_token_ids",
     "PAGESTREAM_MAX_PROMPT_TOKEN_IDS"),
    (dict(prompt_token_ids=[2**31]), "prompt_token_ids", "must be in [0, 2147483647]"),
    (dict(metadata={"blob": "m" * DEFAULTS.max_metadata_bytes}), "metadata", "PAGESTREAM_MAX_METADATA_BYTES"),
    (dict(metadata={"a": [[[[[[[[["deep"]]]]]]]]]}), "metadata", "PAGESTREAM_MAX_METADATA_DEPTH"),
    (dict(metadata={"note": "\ud800"}), "metadata", "lone surrogate"),
    (dict(metadata={"x": float("nan")}), "metadata.x.float", "finite number"),
    (dict(stop=[f"s{i}" for i in range(DEFAULTS.max_stop_strings + 1)]), "sampling.stop",
     "PAGESTREAM_MAX_STOP_STRINGS"),
    (dict(stop=["z" * (DEFAULTS.max_stop_string_bytes + 1)]), "sampling.stop", "PAGESTREAM_MAX_STOP_STRING_BYTES"),
    (dict(stop_token_ids=list(range(DEFAULTS.max_stop_token_ids + 1))), "sampling.stop_token_ids",
     "PAGESTREAM_MAX_STOP_TOKEN_IDS"),
    (dict(max_tokens=DEFAULTS.max_tokens + 1), "sampling.max_tokens", "PAGESTREAM_MAX_TOKENS"),
    (dict(min_tokens=DEFAULTS.max_tokens + 1, max_tokens=None), "sampling.min_tokens", "PAGESTREAM_MAX_TOKENS"),
    (dict(n=DEFAULTS.max_n + 1), "sampling.n", "PAGESTREAM_MAX_N"),
    (dict(result_ttl_s=10**17), "result_ttl_s", "PAGESTREAM_MAX_RESULT_TTL_S"),
    (dict(top_k=2**63), "sampling.top_k", "less than or equal to 2147483647"),
    (dict(temperature=float("inf")), "sampling.temperature", "finite number"),
    (dict(ttl_s=float("inf")), "ttl_s", "finite number"),
]


def _fields(kw: dict) -> dict:
    return kw if {"prompt", "messages", "prompt_token_ids"} & kw.keys() else {"prompt": "hello", **kw}


@pytest.fixture
def limits_from_env(monkeypatch):
    """Set PAGESTREAM_MAX_* for this test; the process's limits are re-read before and after."""
    def set_env(**env: int) -> None:
        for k, v in env.items():
            monkeypatch.setenv(f"PAGESTREAM_{k.upper()}", str(v))
        job_limits.cache_clear()

    yield set_env
    monkeypatch.undo()
    job_limits.cache_clear()


@pytest.mark.parametrize("kw,field,words", OVER_LIMIT, ids=[o[1] + "-" + o[2][:24] for o in OVER_LIMIT])
def test_submit_refuses_what_is_over_a_limit_and_queues_nothing(producer, r, kw, field, words):
    with pytest.raises(ValidationError) as info:
        producer.submit(**_fields(kw))
    errors = {".".join(map(str, e["loc"])): e["msg"] for e in info.value.errors()}
    assert field in errors, errors
    assert words in errors[field], errors
    assert r.xlen(keys.jobs_stream("normal")) == 0 and not r.keys("*")


def test_the_largest_allowed_job_is_accepted_and_fits_an_entry(producer, r):
    lim = DEFAULTS
    job = JobRequest(
        prompt="\u00e9" * (lim.max_prompt_bytes // 2), max_tokens=lim.max_tokens, n=lim.max_n,
        stop=["\x01" * lim.max_stop_string_bytes] * lim.max_stop_strings,
        stop_token_ids=list(range(lim.max_stop_token_ids)), result_ttl_s=lim.max_result_ttl_s,
        metadata={"blob": "\x02" * ((lim.max_metadata_bytes - 64) // 6), "deep": [[[[[[1]]]]]]})  # 6 bytes escaped
    job_id = producer.submit(job)
    (_, fields), = r.xrange(keys.jobs_stream("normal"))
    assert len(fields[b"job"]) <= lim.max_entry_bytes
    assert JobRequest.model_validate_json(fields[b"job"]) == job
    assert producer.status(job_id) == JobStatus.QUEUED


def test_limits_come_from_the_environment(producer, limits_from_env):
    limits_from_env(max_prompt_bytes=10, max_n=2, max_result_ttl_s=60)
    producer.submit(prompt="0123456789", n=2, result_ttl_s=60)
    for kw, setting in [(dict(prompt="0123456789a"), "PAGESTREAM_MAX_PROMPT_BYTES"),
                        (dict(prompt="a", n=3), "PAGESTREAM_MAX_N"),
                        (dict(prompt="a", result_ttl_s=61), "PAGESTREAM_MAX_RESULT_TTL_S")]:
        with pytest.raises(ValidationError, match=setting):
            producer.submit(**kw)


def test_a_worker_refuses_over_limit_entries_written_by_hand_and_serves_the_rest(redis_url, producer, tmp_path):
    """Someone with Redis access XADDs jobs the producer would have refused: each ends failed with the
    reason; the good job queued behind them completes."""
    r = redis.Redis.from_url(redis_url)
    stream = keys.jobs_stream("normal")
    hostile = {
        "big-ttl": dict(result_ttl_s=10**17),
        "many-stops": dict(sampling={"stop": ["x"] * 200_000}),
        "too-many-samples": dict(sampling={"n": 1000}),
        "long-prompt": dict(prompt="p" * (DEFAULTS.max_prompt_bytes + 1)),
    }
    for job_id, kw in hostile.items():
        payload = {"job_id": job_id, "prompt": "hello", "created_at": 1.0, **kw}
        r.xadd(stream, {"job": json.dumps(payload)})
    good = producer.submit(prompt="a good job", max_tokens=4)
    w = WorkerProc(redis_url, "fake", "limits-w", "--burst", log_dir=tmp_path)
    assert w.proc.wait(120) == 0, w.log()
    assert producer.result(good, timeout=10).status == JobStatus.COMPLETED
    for job_id, kw in hostile.items():
        res = producer.result(job_id, timeout=10)
        field = next(iter(kw)) if "sampling" not in kw else "sampling." + next(iter(kw["sampling"]))
        assert res.status == JobStatus.FAILED and field in res.error, (job_id, res.error)
        assert "PAGESTREAM_MAX_" in res.error, (job_id, res.error)
