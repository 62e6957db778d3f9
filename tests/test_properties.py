"""Property-based tests over the producer-side input surfaces (issue 8, acceptance 2).

Each surface gets >= 2,000 generated inputs in CI (the ``ci`` profile in conftest:
``derandomize=True``, so every run draws the same ones) and 50,000 fresh ones with
``PAGESTREAM_HYPOTHESIS_PROFILE=nightly``:

- sampling parameters: a valid set round-trips through JSON unchanged and the engine's
  ``SamplingParams`` takes it; an invalid one is a ``ValidationError`` naming the field;
- ``JobRequest``: the same, and a valid job's lane entry fits ``max_entry_bytes`` and is
  read back by the worker's parser (``loads_untrusted``) into an equal job;
- bulk JSONL lines: each gives a job or an error line with its number, never an exception;
- RQ payloads planted on the bulk queue (any function name, arguments, callbacks, or raw
  job data) never run anything, and the bulk worker keeps going.

The limits are made small here so the generated inputs cross every one of them.
"""
from __future__ import annotations

import json
import logging
import os

import pytest
import redis
from hypothesis import event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from rq import Callback, Queue, SimpleWorker
from rq.serializers import JSONSerializer

from pagestream.engine.sampling_params import SamplingParams
from pagestream.producer.bulk.api import BulkSpec
from pagestream.producer.bulk.io import BadLine, BulkRequest, max_line_bytes, parse_line
from pagestream.producer.bulk.orchestrator import bulk_job
from pagestream.producer.bulk.rq_queue import BULK_QUEUE, RUN_BULK_FUNC, bulk_queue
from pagestream.producer.protocol.limits import job_limits
from pagestream.producer.protocol.schema import JOB_ID_PATTERN, SAMPLING_FIELDS, JobRequest, SamplingOptions
from pagestream.producer.protocol.wire import job_fields, loads_untrusted
from tests.conftest import REDIS_DB, REDIS_HOST, REDIS_PORT

SMALL_LIMITS = dict(max_prompt_bytes=64, max_prompt_token_ids=16, max_messages=4, max_metadata_bytes=256,
                    max_metadata_depth=3, max_stop_strings=4, max_stop_string_bytes=8, max_stop_token_ids=8,
                    max_tokens=64, max_n=4, max_result_ttl_s=1000)


@pytest.fixture(scope="module", autouse=True)
def small_limits():
    saved = {k: os.environ.get(f"PAGESTREAM_{k.upper()}") for k in SMALL_LIMITS}
    os.environ.update({f"PAGESTREAM_{k.upper()}": str(v) for k, v in SMALL_LIMITS.items()})
    job_limits.cache_clear()
    yield
    for k, v in saved.items():
        os.environ.pop(f"PAGESTREAM_{k.upper()}", None) if v is None else os.environ.__setitem__(f"PAGESTREAM_{k.upper()}", v)
    job_limits.cache_clear()


# ---- strategies ---------------------------------------------------------------------------------

# any code point, lone surrogates included
any_text = st.text(st.characters(exclude_categories=()), max_size=12)
floats = st.floats(-3, 3) | st.integers(-3, 3) | st.floats(allow_nan=True, allow_infinity=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | floats | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3), max_leaves=8)
junk = json_values | st.sets(st.integers(), max_size=2) | st.binary(max_size=4)


def maybe(valid, bad=junk):
    """Mostly a value the field takes, one draw in ten a wrong one (``bad``) or anything at all."""
    return st.integers(0, 9).flatmap(lambda i: (bad | junk) if i == 0 else valid)


text = st.text(max_size=10)  # no surrogates: the valid side
SAMPLING_VALUES = {
    "n": maybe(st.integers(1, 4), st.integers(-1, 6)),
    "temperature": maybe(st.floats(0, 2), floats),
    "top_p": maybe(st.floats(0.01, 1), floats),
    "top_k": maybe(st.integers(-1, 50), st.integers(-3, 2**64)),
    "min_p": maybe(st.floats(0, 1), floats),
    "repetition_penalty": maybe(st.floats(0.1, 2), floats),
    "presence_penalty": maybe(st.floats(-2, 2), floats),
    "frequency_penalty": maybe(st.floats(-2, 2), floats),
    "seed": maybe(st.none() | st.integers(0, 2**63 - 1), st.integers(-1, 2**64)),
    "max_tokens": maybe(st.none() | st.integers(1, 64), st.integers(-1, 80)),
    "min_tokens": maybe(st.integers(0, 4), st.integers(-1, 80)),
    "stop": maybe(st.none() | text | st.lists(text, max_size=4), any_text | st.lists(any_text, max_size=6)),
    "stop_token_ids": maybe(st.none() | st.lists(st.integers(0, 1000), max_size=8),
                            st.lists(st.integers(-1, 2**32), max_size=10)),
    "ignore_eos": maybe(st.booleans()),
    "skip_special_tokens": maybe(st.booleans()),
    "include_stop_str_in_output": maybe(st.booleans()),
    "logprobs": maybe(st.none() | st.integers(0, 20), st.integers(-2, 25)),
    "prompt_logprobs": maybe(st.none() | st.integers(0, 20), st.integers(-2, 25)),
    "structured_outputs": maybe(
        st.none() | st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[a-z]{1,8}"}, {"json": {"type": "object"}},
                                     {"json_object": True}]),
        st.sampled_from([{"choice": []}, {"regex": "("}, {"json": {"type": 5}}, {"choice": ["a"], "regex": "a"}, {}])),
    "response_format": maybe(
        st.none() | st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                     {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}]),
        st.sampled_from([{"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}])),
    "logit_bias": maybe(st.none() | st.dictionaries(st.integers(0, 1000).map(str), st.floats(-100, 100), max_size=4),
                        st.dictionaries(st.integers(-2, 2**32).map(str) | text, st.floats(-300, 300), min_size=1, max_size=4)),
    "allowed_token_ids": maybe(st.none() | st.lists(st.integers(0, 1000), min_size=1, max_size=8),
                               st.lists(st.integers(-1, 2**32), max_size=10)),
}
assert set(SAMPLING_VALUES) == SAMPLING_FIELDS
sampling_dicts = st.fixed_dictionaries({}, optional={**SAMPLING_VALUES, "bogus_field": junk})

messages = st.lists(st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["system", "user", "assistant", "tool"]), st.just("developer")),
     "content": maybe(text, any_text | st.text(min_size=60, max_size=80))}), min_size=1, max_size=5)
prompts = maybe(text.filter(bool), any_text | st.text(min_size=60, max_size=80))
json_metadata = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text,
                             lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                             max_leaves=6)
job_dicts = st.fixed_dictionaries({}, optional={
    "prompt": prompts,
    "messages": maybe(messages),
    "prompt_token_ids": maybe(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=16),
                              st.lists(st.integers(-1, 2**32), max_size=20)),
    "sampling": maybe(sampling_dicts),
    "n": SAMPLING_VALUES["n"],
    "max_tokens": SAMPLING_VALUES["max_tokens"],
    "stop": SAMPLING_VALUES["stop"],
    "job_id": maybe(st.from_regex(JOB_ID_PATTERN, fullmatch=True), any_text),
    "lane": maybe(st.sampled_from(["high", "normal", "low"]), st.just("urgent")),
    "priority": maybe(st.integers(-10, 10), st.integers(-(2**70), 2**70)),
    "ttl_s": maybe(st.floats(0.1, 1e6), floats),
    "result_ttl_s": maybe(st.integers(1, 1000), st.integers(-5, 10**18)),
    "metadata": maybe(st.dictionaries(text, json_metadata, max_size=4), st.dictionaries(any_text, json_values, max_size=4)),
    "model": maybe(st.none() | text, any_text),
    "schema_version": maybe(st.just(1), st.integers(-1, 3)),
    "created_at": maybe(st.floats(0, 2e9), floats),
    "output": maybe(st.fixed_dictionaries({}, optional={"kind": st.sampled_from(["redis", "bulk"]),
                                                        "bulk_id": maybe(text), "custom_id": maybe(text)})),
})


def assert_names_fields(exc: ValidationError, given_fields: dict, model) -> None:
    """Every error says which field: a location starting at a given field, or a message naming one."""
    known = set(model.model_fields) | set(given_fields)
    for err in exc.errors():
        loc = [str(x) for x in err["loc"]]
        if loc:
            assert loc[0] in given_fields or (loc[0] == "sampling" and (len(loc) < 2 or loc[1] in SAMPLING_FIELDS | set(given_fields))), err
        else:
            assert any(name in err["msg"] for name in known), err
        assert err["msg"], err


# ---- sampling parameters and JobRequest -----------------------------------------------------------

def validated(model, data: dict):
    """``model`` built from ``data``, or None after checking the ValidationError names the field."""
    try:
        value = model.model_validate(data)
    except ValidationError as exc:
        event("invalid")
        assert_names_fields(exc, data, model)
        return None
    event("valid")
    return value


@given(sampling_dicts)
def test_sampling_params_round_trip_or_name_the_field(data):
    if (opts := validated(SamplingOptions, data)) is not None:
        assert SamplingOptions.model_validate_json(opts.model_dump_json(exclude_none=True)) == opts
        SamplingParams(**opts.engine_kwargs())  # the engine takes whatever the schema accepts


@given(job_dicts)
def test_job_requests_round_trip_through_a_lane_entry_or_name_the_field(data):
    if (job := validated(JobRequest, data)) is not None:
        entry = job_fields(job)["job"]
        limit = job_limits().max_entry_bytes
        assert len(entry.encode("utf-8")) <= limit
        assert JobRequest.model_validate(loads_untrusted(entry.encode("utf-8"), max_bytes=limit)) == job


# ---- bulk lines -----------------------------------------------------------------------------------

SPEC = BulkSpec(bulk_id="batch_props", input="/in.jsonl", output="/out")
line_sampling = {**SAMPLING_VALUES, "n": maybe(st.just(1)), "max_completion_tokens": maybe(st.integers(1, 64)),
                 # chat spells them logprobs: true + top_logprobs: k, completions logprobs: k; a line may mix them up
                 "logprobs": maybe(st.none() | st.booleans() | st.integers(0, 20), st.integers(-2, 25)),
                 "top_logprobs": maybe(st.none() | st.integers(0, 20), st.integers(-2, 25))}
custom_ids = maybe(text.filter(bool), any_text)


def _request(extra: dict, chat: bool):
    """A plain line or batch body: mostly one of prompt/messages, one in ten both (chat) or neither."""
    key, value = ("messages", maybe(messages)) if chat else ("prompt", maybe(prompts | st.lists(text, min_size=1, max_size=1)))
    base = st.fixed_dictionaries({key: value}, optional={**line_sampling, **extra})

    def odd_one(t):
        req, roll, prompt = t
        if roll:
            return req
        return {**req, "prompt": prompt} if chat else {k: v for k, v in req.items() if k != "prompt"}

    return st.tuples(base, st.integers(0, 9), prompts).map(odd_one)


plain_lines = st.booleans().flatmap(lambda chat: _request({"custom_id": custom_ids}, chat))
batch_lines = st.booleans().flatmap(lambda chat: st.fixed_dictionaries({
    "custom_id": custom_ids,
    "method": maybe(st.just("POST"), st.just("GET")),
    "url": maybe(st.just("/v1/chat/completions" if chat else "/v1/completions"), st.just("/v1/embeddings")),
    "body": maybe(_request({}, chat))}))


def _encode(obj, ascii_only: bool) -> bytes:
    try:
        text = json.dumps(obj, ensure_ascii=ascii_only, default=repr)
    except (ValueError, RecursionError):
        return b"{}"
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate becomes invalid UTF-8, as on disk


bulk_lines = st.one_of(
    st.tuples(plain_lines | batch_lines | json_values, st.booleans()).map(lambda t: _encode(*t)),
    st.binary(max_size=80),
    st.integers(20, 3000).map(lambda n: b"[" * n),
    st.integers(20, 3000).map(lambda n: b'{"prompt": "x", "metadata": ' + b'{"a": ' * n + b"1" + b"}" * (n + 1)),
    st.integers(-3, 3).map(lambda d: b'{"prompt": "' + b"p" * (max_line_bytes() + d - 14) + b'"}'),
    st.sampled_from([b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "\\ud800"}', b"", b"   ", b"{", b"null"]),
)


@given(bulk_lines)
def test_each_bulk_line_gives_a_job_or_an_error_line(raw):
    item = parse_line(raw, 7)
    if item is None:
        event("blank")
        assert not raw.decode("utf-8").strip()
        return
    if isinstance(item, BulkRequest):
        item = bulk_job(item, SPEC)
    if isinstance(item, BadLine):
        event("error line")
        assert item.line == 7 and isinstance(item.reason, str) and 0 < len(item.reason) < 2_000, item
        return
    event("job")
    JobRequest(**item)


# ---- RQ payloads on the bulk queue ----------------------------------------------------------------

DANGEROUS = ["os.system", "subprocess.check_call", "subprocess.run", "builtins.exec", "builtins.eval",
             "builtins.open", "pathlib.Path.touch", "shutil.rmtree", "pagestream.producer.bulk.api.cancel_bulk",
             "pagestream.producer.bulk.orchestrator.Orchestrator", RUN_BULK_FUNC, RUN_BULK_FUNC + ".__call__"]


@pytest.fixture(scope="module")
def rq_setup(tmp_path_factory):
    marker = tmp_path_factory.mktemp("rq") / "ran"
    conn = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    conn.flushdb()
    logging.getLogger("rq").setLevel(logging.CRITICAL)
    yield conn, marker
    conn.flushdb()


def payloads(marker: str):
    names = st.sampled_from(DANGEROUS) | st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,3}", fullmatch=True) | any_text
    args = st.sampled_from([[f"touch {marker}"], [["touch", marker]], [marker], [marker, "w"],
                            ["exec(\"open('%s', 'w')\")" % marker], ["batch_x"]]) | st.lists(json_values, max_size=3)
    kwargs = st.sampled_from([{}, {"redis_url": "redis://203.0.113.1:6379/0"}, {"shell": True}]) | \
        st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), json_values, max_size=2)
    callbacks = st.none() | st.sampled_from(DANGEROUS[:8])
    enqueued = st.fixed_dictionaries({"kind": st.just("enqueue"), "func": names, "args": args, "kwargs": kwargs,
                                      "on_success": callbacks, "on_failure": callbacks, "on_stopped": callbacks})
    raw = st.fixed_dictionaries({"kind": st.just("raw"),
                                 "data": st.binary(max_size=40) | st.tuples(names, st.none(), args, kwargs).map(
                                     lambda t: json.dumps(list(t), default=repr).encode("utf-8", "surrogatepass")),
                                 "fields": st.dictionaries(st.sampled_from(
                                     ["success_callback_name", "failure_callback_name", "stopped_callback_name",
                                      "meta", "status", "timeout", "dependency_ids"]),
                                     st.sampled_from(DANGEROUS[:8]).map(str.encode) | st.binary(max_size=20),
                                     max_size=3)})
    return enqueued | raw


def _plant(conn: redis.Redis, p: dict) -> None:
    plain = Queue(BULK_QUEUE, connection=conn, serializer=JSONSerializer)
    if p["kind"] == "enqueue":
        cbs = {k: Callback(p[k]) for k in ("on_success", "on_failure", "on_stopped") if p[k]}
        try:
            func = p["func"].encode("utf-8").decode("utf-8")
        except UnicodeEncodeError:
            func = "x"  # RQ itself cannot store it
        plain.enqueue(func, args=p["args"], kwargs=p["kwargs"], **cbs)
        return
    job = plain.enqueue("os.getpid")
    conn.hset(job.key, mapping={"data": p["data"], **p["fields"]})


class _QuietWorker(SimpleWorker):
    """The bulk-worker's RQ worker without the pubsub thread for remote commands (joining it
    costs ~25 ms a run; payload handling never goes through it)."""

    def subscribe(self):
        pass

    def unsubscribe(self):
        pass


def test_rq_payloads_on_the_bulk_queue_never_run_anything(rq_setup):
    conn, marker = rq_setup
    q = bulk_queue(conn)

    runs = []

    @given(payloads(str(marker)))
    def check(p):
        runs.append(p["kind"])
        _plant(conn, p)
        worker = _QuietWorker([q], connection=conn, serializer=q.serializer, job_class=q.job_class)
        worker.work(burst=True, logging_level="CRITICAL")  # returns normally: the worker survives every payload
        assert not marker.exists(), p
        assert q.count == 0  # every job was taken (and failed), none left to block the queue

    check()
    assert len(runs) >= settings().max_examples and {"enqueue", "raw"} <= set(runs)
