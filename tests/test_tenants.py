"""Tenants isolated by API key (issue 22, acceptance 1): with two tenants' keys, every files and batches
endpoint answers 404 for the other tenant's objects and lists only the caller's; an admin key sees all.

Against a gateway process, a worker on the fake engine, a bulk-worker and a real Redis, driven with the
official openai client."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from gateway_helpers import batch_stack, openai_client
from pagestream.producer.protocol.tenants import parse_key_spec, tenant_of_key

MODEL = "fake-tenant-model"
ALICE, BOB, OPS, PLAIN = ("alice-secret-4f1c9a", "bob-secret-77d0e2", "ops-secret-a93b11", "plain-secret-0c5d6e")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("tenants")
    keys_file = log_dir / "keys.txt"
    keys_file.write_text(f"# ops\n{OPS}:ops:admin\n\n{PLAIN}   # a key without a tenant name\n")
    with batch_stack(log_dir, tmp_path_factory.mktemp("files"), MODEL, "tenant-worker", "--api-keys", f"{ALICE}:alice,{BOB}:bob",
                     gateway_env={"PAGESTREAM_GATEWAY_API_KEYS_FILE": str(keys_file)}) as s:
        yield s


def client(stack, key: str) -> openai.OpenAI:
    return openai_client(stack["gw"], key)


def line(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": cid}], "max_tokens": 3, **body}}


def upload(c: openai.OpenAI, lines: list, tmp_path, name: str = "requests.jsonl") -> openai.types.FileObject:
    path = tmp_path / name
    path.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
    with open(path, "rb") as f:
        return c.files.create(file=f, purpose="batch")


def wait_final(c: openai.OpenAI, batch_id: str, stack, timeout: float = 240.0) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        if time.monotonic() > deadline:
            logs = "\n".join(p.read_text()[-3000:] for p in stack["log_dir"].iterdir() if p.suffix == ".log")
            raise AssertionError(f"batch {batch_id} still {b.status} after {timeout} s\n{logs}")
        time.sleep(0.5)


def not_found(call, *args, **kwargs) -> dict:
    """The call answers 404 (not 403, not 200): the other tenant's object does not exist for the caller."""
    with pytest.raises(openai.NotFoundError) as info:
        resp = call(*args, **kwargs)
        if hasattr(resp, "read"):
            resp.read()
    return info.value.body


def all_ids(pager) -> list[str]:
    return [x.id for x in pager]


def test_files_are_scoped_to_their_tenant(stack, tmp_path):
    alice, bob, ops = client(stack, ALICE), client(stack, BOB), client(stack, OPS)
    fa = upload(alice, [line("a1")], tmp_path)
    fb = upload(bob, [line("b1")], tmp_path)
    assert fa.id in all_ids(alice.files.list()) and fb.id not in all_ids(alice.files.list())
    assert fb.id in all_ids(bob.files.list()) and fa.id not in all_ids(bob.files.list())
    assert {fa.id, fb.id} <= set(all_ids(ops.files.list()))  # the admin sees every tenant's

    # every verb on alice's file, asked by bob: 404, saying only that there is no such file
    for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
        body = not_found(call, fa.id)
        assert body["code"] == "not_found" and fa.id in body["message"] and "alice" not in body["message"]
    mine, nobodys = not_found(bob.files.retrieve, fa.id), not_found(bob.files.retrieve, "file-0000000000000000000000")
    assert mine.keys() == nobodys.keys() and mine["code"] == nobodys["code"] and mine["type"] == nobodys["type"]
    not_found(bob.batches.create, input_file_id=fa.id, endpoint="/v1/chat/completions", completion_window="24h")
    # nothing of alice's was touched by bob's attempts
    assert alice.files.content(fa.id).read() == (json.dumps(line("a1")) + "\n").encode()
    assert ops.files.retrieve(fa.id).id == fa.id and ops.files.content(fb.id).read().startswith(b'{"custom_id": "b1"')

    assert alice.files.delete(fa.id).deleted
    not_found(alice.files.retrieve, fa.id)
    assert fa.id not in all_ids(ops.files.list())


def test_batches_and_their_outputs_are_scoped(stack, tmp_path):
    alice, bob, ops = client(stack, ALICE), client(stack, BOB), client(stack, OPS)
    f = upload(alice, [line(f"q{i}") for i in range(3)], tmp_path)
    b = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.id in all_ids(alice.batches.list()) and b.id not in all_ids(bob.batches.list())
    assert b.id in all_ids(ops.batches.list())
    not_found(bob.batches.retrieve, b.id)
    not_found(bob.batches.cancel, b.id)
    done = wait_final(alice, b.id, stack)
    assert done.status == "completed", done  # bob's cancel did not reach it
    assert done.request_counts.completed == 3

    out = done.output_file_id
    for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
        not_found(call, out)
    assert out not in all_ids(bob.files.list()) and out in all_ids(alice.files.list())
    rows = [json.loads(x) for x in alice.files.content(out).read().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == ["q0", "q1", "q2"]
    assert ops.files.retrieve(out).id == out and ops.batches.retrieve(b.id).id == b.id

    # a deleted output file stays deleted: the batch's manifest does not bring it back
    assert alice.files.delete(out).deleted
    for _ in range(2):
        assert alice.batches.retrieve(b.id).output_file_id == out  # retrieving the batch re-reads its manifest
        not_found(alice.files.retrieve, out)
        not_found(alice.files.content, out)
    assert out not in all_ids(alice.files.list())


def test_admin_cancels_any_batch_and_bob_cancels_his_own(stack, tmp_path):
    bob, ops, alice = client(stack, BOB), client(stack, OPS), client(stack, ALICE)
    f = upload(bob, [line(f"slow-{i}", max_tokens=100) for i in range(200)], tmp_path)
    b1 = bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    not_found(alice.batches.cancel, b1.id)
    assert ops.batches.cancel(b1.id).cancelling_at is not None
    assert wait_final(bob, b1.id, stack).status == "cancelled"
    b2 = bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert bob.batches.cancel(b2.id).cancelling_at is not None
    assert wait_final(bob, b2.id, stack).status == "cancelled"


def test_lists_paginate_per_tenant_as_openai_does(stack, tmp_path):
    plain = client(stack, PLAIN)  # a key given without a tenant name is a tenant of its own
    made = [upload(plain, [line(f"p{i}")], tmp_path, f"p{i}.jsonl").id for i in range(5)]
    assert set(all_ids(client(stack, ALICE).files.list())).isdisjoint(made)
    base = stack["gw"].base_url
    headers = {"Authorization": f"Bearer {PLAIN}"}
    seen, after, pages = [], None, 0
    while True:
        params = {"limit": 2} | ({"after": after} if after else {})
        page = httpx.get(f"{base}/files", params=params, headers=headers, timeout=30).json()
        ids = [x["id"] for x in page["data"]]
        assert page["first_id"] == ids[0] and page["last_id"] == ids[-1] and len(ids) <= 2
        seen += ids
        pages += 1
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert pages == 3 and seen == list(reversed(made))  # newest first, each exactly once
    # another tenant's id as the cursor reveals nothing
    alice_file = upload(client(stack, ALICE), [line("x")], tmp_path).id
    empty = httpx.get(f"{base}/files", params={"after": alice_file}, headers=headers, timeout=30).json()
    assert empty["data"] == [] and empty["has_more"] is False
    # the SDK's auto-pagination walks the same pages
    assert all_ids(plain.files.list(limit=2)) == list(reversed(made))


def test_keys_never_reach_redis_or_the_log(stack, tmp_path):
    alice = client(stack, ALICE)
    f = upload(alice, [line("k")], tmp_path)
    upload(client(stack, PLAIN), [line("p")], tmp_path)  # a key with no tenant name: its records go under one made of it
    b = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_final(alice, b.id, stack)
    chat = alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content
    httpx.get(f"{stack['gw'].base_url}/files", headers={"Authorization": "Bearer not-a-key-5e5e"}, timeout=30)
    r = stack["r"]
    dump = []
    for key in r.scan_iter(count=1000):
        dump.append(key)
        kind = r.type(key)
        if kind == b"hash":
            dump += [x for kv in r.hgetall(key).items() for x in kv]
        elif kind == b"string":
            dump.append(r.get(key))
        elif kind == b"zset":
            dump += r.zrange(key, 0, -1)
        elif kind == b"stream":
            dump += [x for _, fields in r.xrange(key) for kv in fields.items() for x in kv]
        elif kind == b"list":
            dump += r.lrange(key, 0, -1)
        elif kind == b"set":
            dump += list(r.smembers(key))
    blob = b"\n".join(x if isinstance(x, bytes) else str(x).encode() for x in dump)
    assert b"alice" in blob and b"ps:files:t:{alice}" in blob  # the tenant's name is there, in its index
    for secret in (ALICE, BOB, OPS, PLAIN):
        assert secret.encode() not in blob
        assert secret not in stack["gw"].log()
    assert tenant_of_key(PLAIN).encode() in blob
    # the chat job carries its tenant too (a job's compact JSON; file records are spelled '"tenant": "alice"')
    assert b'"tenant":"alice"' in blob


def test_strict_query_and_metadata_limits(stack, tmp_path):
    base, headers = stack["gw"].base_url, {"Authorization": f"Bearer {ALICE}"}
    for path in ("files", "batches"):
        for bad in ("²", "0", "-1", "1e3", " 5", "10001" if path == "files" else "99999999999"):
            resp = httpx.get(f"{base}/{path}", params={"limit": bad}, headers=headers, timeout=30)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "limit", (path, bad, resp.text)
    alice = client(stack, ALICE)
    f = upload(alice, [line("m")], tmp_path)
    for metadata, word in (({f"k{i}": "v" for i in range(17)}, "metadata"), ({"k" * 65: "v"}, "metadata"),
                           ({"k": "v" * 513}, "metadata")):
        with pytest.raises(openai.UnprocessableEntityError) as info:
            alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata=metadata)
        assert word in info.value.body["param"]
    ok = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"k" * 64: "v" * 512})
    assert ok.metadata == {"k" * 64: "v" * 512}


def test_key_specs():
    assert parse_key_spec("abc:team-a:admin")[1].admin and parse_key_spec("abc:team-a")[1].name == "team-a"
    assert parse_key_spec("abc")[1].name == tenant_of_key("abc") != parse_key_spec("abd")[1].name
    assert "abc" not in tenant_of_key("abc")
    from pydantic import ValidationError

    from pagestream.producer.gateway.settings import GatewaySettings

    for bad in ("s3cr3t-key:bad name", "s3cr3t-key:t:root", "s3cr3t-key:a,s3cr3t-key:b", ":t"):
        with pytest.raises(ValidationError) as info:
            GatewaySettings(api_keys=bad)
        assert "s3cr3t" not in str(info.value) and "s3cr3t" not in repr(GatewaySettings())
