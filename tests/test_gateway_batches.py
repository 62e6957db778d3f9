"""OpenAI's Batch API on the gateway (issue 10, acceptance 4): the official openai client uploads a file and
creates a batch against a gateway process, a real Redis, a worker running the fake engine and a bulk-worker."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from gateway_helpers import batch_stack
from pagestream.worker.fake_engine import FakeEngine

MODEL = "fake-batch-model"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with batch_stack(tmp_path_factory.mktemp("batches"), tmp_path_factory.mktemp("files"), MODEL, "batch-worker") as s:
        yield s


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["gw"].base_url, api_key="unused", max_retries=0, timeout=120)


def chat_line(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"model": MODEL, **body}}


def upload(c: openai.OpenAI, lines: list, tmp_path) -> openai.types.FileObject:
    path = tmp_path / "requests.jsonl"
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    with open(path, "rb") as f:
        return c.files.create(file=f, purpose="batch")


def wait_final(c: openai.OpenAI, batch_id: str, stack, timeout: float = 240.0) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        if time.monotonic() > deadline:
            logs = "\n".join(p.read_text()[-3000:] for p in stack["log_dir"].iterdir())
            raise AssertionError(f"batch {batch_id} still {b.status} after {timeout} s\n{logs}")
        time.sleep(0.5)


def raw_batch(c: openai.OpenAI, batch_id: str) -> openai.types.Batch:
    """The Batch as sent, validated strictly (the SDK itself builds objects without validation), and
    holding OpenAI's fields only: no server paths or internal fields (issue 37: ``input``, ``output``,
    ``rq_job_id``, ``manifest``, ``lines_read`` were there)."""
    sent = c.batches.with_raw_response.retrieve(batch_id).http_response.json()
    assert set(sent) <= set(openai.types.Batch.model_fields), set(sent) - set(openai.types.Batch.model_fields)
    assert "/" not in json.dumps({k: v for k, v in sent.items() if k not in ("endpoint", "metadata")}), sent
    return openai.types.Batch.model_validate(sent)


def test_files_and_batch_to_completed_output_validates(stack, tmp_path):
    c = client(stack)
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    lines = [
        chat_line("parts", messages=[{"role": "user", "content": parts}], max_tokens=5, seed=1),
        chat_line("two", messages=[{"role": "user", "content": "pick"}], n=2, max_completion_tokens=3, seed=2),
        chat_line("no-max", messages=[{"role": "developer", "content": "be long"}, {"role": "user", "content": "go"}]),
        chat_line("lp", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2, max_tokens=4, seed=3),
        chat_line("lp-21", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21),
        {"custom_id": "other-url", "method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "p"}},
        b"{not json",
    ]
    f = upload(c, lines, tmp_path)
    assert f.purpose == "batch" and f.bytes == (tmp_path / "requests.jsonl").stat().st_size
    assert c.files.retrieve(f.id).filename == "requests.jsonl"
    assert f.id in [x.id for x in c.files.list()]
    assert c.files.content(f.id).read() == (tmp_path / "requests.jsonl").read_bytes()

    created = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"run": "acceptance-4"})
    assert created.status in ("validating", "in_progress") and created.input_file_id == f.id
    done = wait_final(c, created.id, stack)
    assert done.status == "completed", done
    batch = raw_batch(c, created.id)
    assert batch.endpoint == "/v1/chat/completions" and batch.completion_window == "24h" and batch.metadata == {"run": "acceptance-4"}
    assert isinstance(batch.created_at, int) and batch.completed_at >= batch.created_at
    assert batch.request_counts.total == 7 and batch.request_counts.completed == 4 and batch.request_counts.failed == 3

    out = [json.loads(x) for x in c.files.content(batch.output_file_id).read().splitlines()]
    assert [o["custom_id"] for o in out] == ["parts", "two", "no-max", "lp"]
    bodies = {}
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200
        bodies[o["custom_id"]] = openai.types.chat.ChatCompletion.model_validate(o["response"]["body"])
    assert all(b.model == MODEL for b in bodies.values())
    fake = FakeEngine()
    prompt = fake.tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert bodies["parts"].choices[0].message.content == fake.expected_text(prompt, 1, 5)
    assert [ch.index for ch in bodies["two"].choices] == [0, 1]
    assert bodies["two"].choices[0].message.content != bodies["two"].choices[1].message.content
    assert bodies["two"].usage.completion_tokens == 6
    # no max_tokens: runs until the context is full, not OpenAI's old 16
    no_max = bodies["no-max"]
    assert no_max.choices[0].finish_reason == "length" and no_max.usage.prompt_tokens + no_max.usage.completion_tokens == 128
    # logprobs in OpenAI's chat shape, the engine's values; lines that did not ask have none
    x_prompt = fake.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    want = fake.expected_logprobs(x_prompt, 3, 4, k=2)
    content = bodies["lp"].choices[0].logprobs.content
    assert [t.token for t in content] == [f"<{next(iter(d))}>" for d in want]
    for t, d in zip(content, want, strict=True):
        assert t.logprob == next(iter(d.values())) and t.bytes == list(t.token.encode())
        assert [(a.token, a.logprob) for a in t.top_logprobs] == [(f"<{i}>", v) for i, v in d.items()]
    assert bodies["parts"].choices[0].logprobs is None

    errors = [json.loads(x) for x in c.files.content(batch.error_file_id).read().splitlines()]
    reasons = {e["custom_id"]: e["error"]["message"] for e in errors}
    assert "logprobs" in reasons["lp-21"] and "less than or equal to 20" in reasons["lp-21"]
    assert "differs from the batch's endpoint" in reasons["other-url"]
    assert "invalid JSON" in reasons[None]
    assert c.files.retrieve(batch.output_file_id).purpose == "batch_output"

    assert c.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)


def test_cancel_and_list(stack, tmp_path):
    c = client(stack)
    lines = [chat_line(f"slow-{i}", messages=[{"role": "user", "content": f"item {i}"}], max_tokens=100) for i in range(300)]
    f = upload(c, lines, tmp_path)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = c.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = wait_final(c, b.id, stack)
    assert done.status == "cancelled" and done.request_counts.completed < 300
    raw_batch(c, b.id)

    # a second batch of this test's own, so the list has two entries whatever ran before (xdist runs files apart)
    other = c.batches.create(input_file_id=upload(c, lines[:1], tmp_path).id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    c.batches.cancel(other.id)
    ids = [x.id for x in c.batches.list(limit=100)]
    assert other.id in ids
    assert b.id in ids and len(ids) >= 2 and len(set(ids)) == len(ids)
    first = c.batches.list(limit=1)
    assert len(first.data) == 1 and first.has_more
    assert [x.id for x in c.batches.list(limit=1, after=first.data[0].id).data] == [ids[1]]


def test_bad_requests_get_openai_errors(stack, tmp_path):
    c = client(stack)
    f = upload(c, [chat_line("a", messages=[{"role": "user", "content": "x"}])], tmp_path)
    cases = [
        (openai.NotFoundError, dict(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"), "file-nope"),
        (openai.BadRequestError, dict(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"), "endpoint"),
        (openai.BadRequestError, dict(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h"), "completion_window"),
    ]
    for exc_type, kwargs, word in cases:
        with pytest.raises(exc_type) as info:
            c.batches.create(**kwargs)
        err = info.value.body
        assert set(err) >= {"message", "type", "param", "code"} and word in err["message"], err
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_doesnotexist")
    with pytest.raises(openai.NotFoundError):
        c.batches.cancel("batch_doesnotexist")
    with pytest.raises(openai.NotFoundError):
        c.files.content("file-doesnotexist")
    with pytest.raises(openai.BadRequestError) as info:
        with open(tmp_path / "requests.jsonl", "rb") as fh:
            c.files.create(file=fh, purpose="fine-tune")
    assert "purpose" in info.value.body["message"]

    base = stack["gw"].base_url
    missing = httpx.post(f"{base}/batches", json={"endpoint": "/v1/chat/completions"}, timeout=30)
    assert missing.status_code == 422 and "input_file_id" in missing.json()["error"]["message"]
    not_json = httpx.post(f"{base}/batches", content=b"{oops", headers={"content-type": "application/json"}, timeout=30)
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
    no_form = httpx.post(f"{base}/files", json={"purpose": "batch"}, timeout=30)
    assert no_form.status_code in (400, 422) and "error" in no_form.json()
    assert httpx.get(f"{stack['gw'].base_url.rsplit('/v1', 1)[0]}/health", timeout=30).status_code == 200
