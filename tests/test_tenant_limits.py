"""Per-tenant limits (issue 22, "What to build"): queued jobs, queued tokens, concurrent streams and open
batches, per tenant. Past a limit the tenant gets 429 in OpenAI's rate-limit shape with retry-after,
before anything is queued, while another tenant is served; once its work ends it is served again, and
the counts come back to zero (nothing leaks), also after a gateway holding its jobs is killed.

Against gateway processes, a fake-engine worker (50 ms a step: a 60-token answer takes ~3 s), a
bulk-worker and a real Redis, driven with the official openai client."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from gateway_helpers import DB_URL, GatewayProc, batch_stack, openai_client
from pagestream.producer.protocol import keys
from queue_helpers import wait_for

MODEL = "fake-limits-model"
ALICE, BOB = "alice-limits-5e1a", "bob-limits-c27f"
LIMITS = {"*": {"max_queued_jobs": 50},  # bob: the default
          "alice": {"max_queued_jobs": 3, "max_queued_tokens": 400, "max_concurrent_streams": 1, "max_open_batches": 1,
                    "retry_after_s": 2}}
GATEWAY_ENV = {"PAGESTREAM_GATEWAY_TENANT_LIMITS": json.dumps(LIMITS)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with batch_stack(tmp_path_factory.mktemp("limits"), tmp_path_factory.mktemp("files"), MODEL, "limits-worker",
                     "--api-keys", f"{ALICE}:alice,{BOB}:bob", gateway_env=GATEWAY_ENV, engine="fake:50",
                     worker_args=("--max-model-len", "1024", "--max-num-seqs", "64")) as s:
        yield s


def ask(c: openai.OpenAI, max_tokens: int = 60, prompt: str = "x"):
    return c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)


def in_background(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def open_jobs(stack, tenant: str = "alice") -> int:
    return stack["r"].zcard(keys.tenant_open_jobs(tenant))


def assert_rate_limited(call, what: str, retry_after: str = "2") -> None:
    """429 in OpenAI's shape, naming the limit, with retry-after."""
    with pytest.raises(openai.RateLimitError) as info:
        call()
    resp = info.value.response
    assert resp.headers["retry-after"] == retry_after
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "rate_limit_exceeded", error
    assert what in error["message"] and error["type"] in ("requests", "tokens"), error


def assert_nothing_open(stack, tenant: str = "alice") -> None:
    """The counts are back to zero: every admitted job was released exactly once."""
    r = stack["r"]
    wait_for(lambda: open_jobs(stack, tenant) == 0, 10, f"{tenant}'s open jobs released")
    assert int(r.hget(keys.tenant_job_tokens(tenant), "total") or 0) == 0


def test_queued_jobs_limit_answers_429_while_another_tenant_is_served(stack):
    alice, bob = openai_client(stack["gw"], ALICE), openai_client(stack["gw"], BOB)
    running = [in_background(ask, alice) for _ in range(3)]
    wait_for(lambda: open_jobs(stack) == 3, 30, "alice's 3 jobs admitted")
    assert_rate_limited(lambda: ask(alice), "queued jobs")
    assert ask(bob, max_tokens=4).choices[0].text  # bob is served meanwhile
    for t, out in running:
        t.join(60)
        assert out and out[0].choices[0].text
    assert_nothing_open(stack)
    assert ask(alice, max_tokens=4).choices[0].text  # served again once its jobs finished
    assert_nothing_open(stack)


def test_limits_hold_exactly_under_a_burst_of_concurrent_requests(stack):
    """10 requests at once against a limit of 3: exactly 3 are admitted (the admission is one script)."""
    alice = openai_client(stack["gw"], ALICE)
    outcomes: list[str] = []

    def one() -> None:
        try:
            ask(alice, max_tokens=40)
            outcomes.append("ok")
        except openai.RateLimitError:
            outcomes.append("429")

    threads = [threading.Thread(target=one) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["429"] * 7 + ["ok"] * 3, outcomes
    assert_nothing_open(stack)


def test_queued_tokens_limit_answers_429_and_a_request_over_it_alone_is_a_400(stack):
    alice, bob = openai_client(stack["gw"], ALICE), openai_client(stack["gw"], BOB)
    big = in_background(ask, alice, 340)  # 1 prompt token + 340 of the 400
    wait_for(lambda: open_jobs(stack) == 1, 30, "alice's big job admitted")
    assert_rate_limited(lambda: ask(alice, 60), "queued tokens")
    assert ask(bob, max_tokens=300).choices[0].text  # bob's budget is his own
    with pytest.raises(openai.BadRequestError) as info:  # no wait would admit it: not a 429
        ask(alice, 500)
    assert info.value.body["code"] == "request_too_large"
    big[0].join(60)
    assert big[1] and big[1][0].choices[0].text
    assert_nothing_open(stack)
    assert ask(alice, 60).choices[0].text


def test_concurrent_streams_limit_answers_429_while_another_tenant_streams(stack):
    alice, bob = openai_client(stack["gw"], ALICE), openai_client(stack["gw"], BOB)

    def stream(c: openai.OpenAI, max_tokens: int = 60) -> str:
        return "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="s", max_tokens=max_tokens,
                                                                           stream=True) if ch.choices)

    first = in_background(stream, alice)
    wait_for(lambda: stack["r"].zcard(keys.tenant_open_streams("alice")) == 1, 30, "alice's stream open")
    assert_rate_limited(lambda: stream(alice), "concurrent streams")
    assert stream(bob, 10)  # bob streams meanwhile
    first[0].join(60)
    assert first[1] and first[1][0]
    wait_for(lambda: stack["r"].zcard(keys.tenant_open_streams("alice")) == 0, 10, "alice's stream slot freed")
    assert stream(alice, 4)  # streams again once the first ended
    assert_nothing_open(stack)


def _batch(c: openai.OpenAI, tmp_path, name: str, max_tokens: int):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"model": MODEL, "prompt": "b", "max_tokens": max_tokens}}) + "\n"
                            for i in range(2)))
    with open(path, "rb") as f:
        file = c.files.create(file=f, purpose="batch")
    return lambda: c.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")


def test_open_batches_limit_answers_429_while_another_tenant_creates_one(stack, tmp_path):
    alice, bob = openai_client(stack["gw"], ALICE), openai_client(stack["gw"], BOB)
    create_a = _batch(alice, tmp_path, "a", 60)
    first = create_a()
    assert_rate_limited(create_a, "open batches")
    bob_batch = _batch(bob, tmp_path, "b", 2)()
    assert bob_batch.status in ("validating", "in_progress")
    deadline = time.monotonic() + 120
    while alice.batches.retrieve(first.id).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, "alice's batch never ended"
        time.sleep(0.3)
    assert alice.batches.retrieve(first.id).status == "completed"
    assert create_a().id  # alice's first batch ended: she may open another


def test_jobs_of_a_gateway_killed_with_kill_9_stop_counting_once_they_end(stack, tmp_path):
    """The counts live in Redis and are swept from the job hashes: another gateway admits the tenant again once
    the jobs a killed gateway held have ended, though nobody released them."""
    doomed = GatewayProc(DB_URL, "--api-keys", f"{ALICE}:alice,{BOB}:bob", log_dir=tmp_path, env=GATEWAY_ENV)
    doomed.wait_ready()
    url = f"{doomed.base_url}/completions"

    def post() -> None:
        try:
            httpx.post(url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=60,
                       json={"model": MODEL, "prompt": "k", "max_tokens": 40})
        except httpx.HTTPError:
            pass  # the gateway is killed under it

    threads = [threading.Thread(target=post) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: open_jobs(stack) == 3, 30, "alice's 3 jobs admitted on the doomed gateway")
    held = stack["r"].zrange(keys.tenant_open_jobs("alice"), 0, -1)
    doomed.proc.kill()
    doomed.proc.wait(10)
    doomed.stop()
    for t in threads:
        t.join(10)
    alice = openai_client(stack["gw"], ALICE)
    assert_rate_limited(lambda: ask(alice, 4), "queued jobs")  # the 3 jobs still run (nobody cancelled them)
    r = stack["r"]
    wait_for(lambda: all(r.hget(keys.job_hash(j.decode()), "status") in (b"completed", b"cancelled", b"failed")
                         for j in held), 30, "the killed gateway's jobs ended")
    assert ask(alice, 4).choices[0].text  # the sweep found them final
    assert_nothing_open(stack)


def test_a_tenants_override_replaces_only_the_fields_it_sets(tmp_path, monkeypatch):
    from pydantic import ValidationError

    from pagestream.producer.gateway.settings import GatewaySettings
    from pagestream.producer.protocol.tenant_limits import TenantLimits

    monkeypatch.setenv("PAGESTREAM_GATEWAY_TENANT_LIMITS", json.dumps(
        {"*": {"max_queued_jobs": 10, "max_concurrent_streams": 2}, "alice": {"max_concurrent_streams": 5}}))
    limits_file = tmp_path / "limits.json"
    limits_file.write_text(json.dumps({"bob": {"max_open_batches": 1, "retry_after_s": 7}}))
    table = GatewaySettings(tenant_limits_file=limits_file).limit_table()
    assert table.of("alice") == TenantLimits(max_queued_jobs=10, max_concurrent_streams=5)
    assert table.of("bob") == TenantLimits(max_queued_jobs=10, max_concurrent_streams=2, max_open_batches=1,
                                           retry_after_s=7)
    assert table.of("carol") == TenantLimits(max_queued_jobs=10, max_concurrent_streams=2)  # the default
    monkeypatch.setenv("PAGESTREAM_GATEWAY_TENANT_LIMITS", json.dumps({"a{b}": {"max_queued_jobs": 1}}))
    with pytest.raises(ValidationError, match="not tenant names"):
        GatewaySettings()
    monkeypatch.setenv("PAGESTREAM_GATEWAY_TENANT_LIMITS", json.dumps({"*": {"max_queued_job": 1}}))
    with pytest.raises(ValidationError, match="max_queued_job"):  # a misspelt limit is an error, not no limit
        GatewaySettings()
    monkeypatch.setenv("PAGESTREAM_GATEWAY_TENANT_LIMITS", json.dumps({"*": {"max_queued_jobs": 0}}))
    with pytest.raises(ValidationError):
        GatewaySettings()


def test_what_a_job_counts_against_the_token_limit():
    from pagestream.producer.protocol.schema import JobRequest
    from pagestream.producer.protocol.tenant_limits import job_tokens

    assert job_tokens(JobRequest(prompt_token_ids=[1, 2, 3], max_tokens=10), 100) == 13
    assert job_tokens(JobRequest(prompt="x" * 9, max_tokens=10, n=2), 100) == 3 + 20  # 9 bytes: 3 tokens
    assert job_tokens(JobRequest(messages=[{"role": "user", "content": "abcd"}], max_tokens=None), 100) == 1 + 100
