"""``pagestream webhook`` (issue 27, acceptance 5) against a real Redis, real job runs (the fake engine worker)
and a real HTTP receiver that fails a fifth of its requests, dedupes by ``webhook-id`` and checks every signature."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.events import Event
from pagestream.producer.protocol.wire import as_str
from pagestream.producer.webhook.consumer import event_body
from pagestream.producer.webhook.signing import (WEBHOOK_ID, WEBHOOK_SIGNATURE, WEBHOOK_TIMESTAMP, secret_key, sign,
                                                 signed_headers, verify)
from tests.queue_helpers import ROOT, WorkerProc, wait_for
from zygote import spawn

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # the spec's serialization: whsec_ + base64 of the key


class Receiver:
    """A webhook endpoint on a free loopback port: ``fail_rate`` of requests answer 500 (half of those after
    recording the event, as a receiver whose answer is lost would), events recorded once per ``webhook-id``."""

    def __init__(self, secret: str, fail_rate: float, seed: int = 27) -> None:
        self.key = secret_key(secret)
        self.fail_rate = fail_rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.recorded: dict[str, dict] = {}  # webhook-id -> the event's body
        self.record_count: Counter = Counter()
        self.requests = 0
        self.failed = 0
        self.bad_signatures = 0
        self.truncated = 0
        self.bad: list = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                if len(body) < length:  # the sender died mid-request (the kill -9): nothing to check or record
                    with receiver.lock:
                        receiver.truncated += 1
                    return
                self.send_response(receiver.handle(self.headers, body))
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, headers, body: bytes) -> int:
        msg_id = headers.get(WEBHOOK_ID, "")
        ok = verify(self.key, msg_id, headers.get(WEBHOOK_TIMESTAMP, ""), headers.get(WEBHOOK_SIGNATURE, ""), body)
        with self.lock:
            self.requests += 1
            if not ok:
                self.bad_signatures += 1
                self.bad.append((msg_id, dict(headers), body[:200]))
                return 401
            roll = self.rng.random()
            if roll < self.fail_rate / 2:  # fails before doing anything
                self.failed += 1
                return 500
            if msg_id not in self.recorded:  # the dedupe: an id seen before is acknowledged, not recorded again
                self.recorded[msg_id] = json.loads(body)
                self.record_count[msg_id] += 1
            if roll < self.fail_rate:  # did its work, then failed to say so
                self.failed += 1
                return 500
            return 200

    def num_recorded(self) -> int:
        with self.lock:
            return len(self.recorded)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class WebhookProc:
    """``pagestream webhook`` as a separate process, its output in a log file."""

    def __init__(self, redis_url: str, url: str, consumer: str, *args: str, log_dir) -> None:
        self.log_path = log_dir / f"{consumer}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "pagestream.worker.cli", "webhook", "--redis-url", redis_url, "--url", url,
               "--group", "hooks", "--consumer", consumer, *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PAGESTREAM_WEBHOOK_SECRET": SECRET}
        self.proc = spawn(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def procs(tmp_path):
    started: list = []
    yield started
    for p in reversed(started):
        p.stop()


def _pending_of(r, group: str) -> dict[str, int]:
    """Entries delivered to each consumer of ``group`` and not acked."""
    return {as_str(c["name"]): c["pending"] for c in r.xinfo_consumers(keys.events_stream(), group)}


def test_every_event_of_1000_jobs_reaches_a_flaky_receiver_once_across_a_kill_9(r, redis_url, producer, procs, tmp_path):
    receiver = Receiver(SECRET, fail_rate=0.2)
    try:
        fast = ("--from", "0", "--concurrency", "16", "--backoff-base", "0.02", "--backoff-cap", "0.5", "--timeout", "5")
        first = WebhookProc(redis_url, receiver.url, "hook-a", *fast, log_dir=tmp_path)
        procs.append(first)
        jobs = producer.submit_many([{"prompt": f"webhook job {i}", "max_tokens": 2, "seed": i} for i in range(1000)])
        worker = WorkerProc(redis_url, "fake", "wh-worker", "--max-num-seqs", "64", log_dir=tmp_path)
        procs.append(worker)

        # kill -9 the consumer while it is midway: some events delivered, others read and still pending
        wait_for(lambda: receiver.num_recorded() >= 600 or first.proc.poll() is not None, 60, "first deliveries")
        assert first.proc.poll() is None, first.log()
        first.proc.kill()
        first.proc.wait(10)
        at_kill = receiver.num_recorded()
        left_pending = _pending_of(r, "hooks").get("hook-a", 0)
        assert left_pending > 0  # it died holding events it had read but not yet delivered

        # every job runs to its end; the stream then holds each job's queued, started, first_token, finished
        for j in jobs:
            producer.result(j, timeout=60)
        entries = {ev.id: ev.fields for ev in producer.events()}
        stream_ids = list(entries)
        assert len(stream_ids) == 4000
        assert at_kill < len(stream_ids), "the kill came after everything was delivered: not midway"

        # another consumer of the group takes over what the dead one left pending (XAUTOCLAIM) and goes on
        second = WebhookProc(redis_url, receiver.url, "hook-b", *fast, "--claim-idle-ms", "500", log_dir=tmp_path)
        procs.append(second)
        wait_for(lambda: receiver.num_recorded() >= len(stream_ids) or second.proc.poll() is not None, 60, "all events")
        assert second.proc.poll() is None, second.log()
        wait_for(lambda: sum(_pending_of(r, "hooks").values()) == 0, 30, "every event acked")

        with receiver.lock:
            recorded, counts = dict(receiver.recorded), Counter(receiver.record_count)
            requests, failed, bad = receiver.requests, receiver.failed, receiver.bad_signatures
        assert set(recorded) == set(stream_ids)  # none missing, none made up
        assert set(counts.values()) == {1}  # each recorded once
        assert bad == 0, receiver.bad  # every complete attempt's signature verified
        assert failed > 0.1 * requests and requests > len(stream_ids)  # the receiver did fail; those were retried
        # each body is its stream entry; every job's events arrived
        assert all(recorded[i]["data"] == entries[i] and recorded[i]["id"] == i for i in stream_ids)
        per_job = Counter(b["data"]["job"] for b in recorded.values())
        assert per_job == Counter({j: 4 for j in jobs})
        assert {b["type"] for b in recorded.values()} == {"queued", "started", "first_token", "finished"}
    finally:
        receiver.close()


def test_a_signature_under_another_secret_or_over_another_body_fails_verification():
    key = secret_key(SECRET)
    ev = Event.parse("1700000000000-0", {"type": "finished", "job": "j1", "ts": "1700000000.5", "tokens": "2"})
    body = event_body(ev)
    h = signed_headers(key, ev.id, body)
    assert h[WEBHOOK_SIGNATURE].startswith("v1,")
    assert verify(key, h[WEBHOOK_ID], h[WEBHOOK_TIMESTAMP], h[WEBHOOK_SIGNATURE], body)
    assert not verify(secret_key("whsec_" + "QUJD" * 8), h[WEBHOOK_ID], h[WEBHOOK_TIMESTAMP], h[WEBHOOK_SIGNATURE], body)
    assert not verify(secret_key("not the secret"), h[WEBHOOK_ID], h[WEBHOOK_TIMESTAMP], h[WEBHOOK_SIGNATURE], body)
    assert not verify(key, h[WEBHOOK_ID], h[WEBHOOK_TIMESTAMP], h[WEBHOOK_SIGNATURE], body.replace(b'"2"', b'"3"'))
    assert not verify(key, "1700000000000-1", h[WEBHOOK_TIMESTAMP], h[WEBHOOK_SIGNATURE], body)  # another id
    old = int(time.time()) - 3600  # a replay of an hour-old attempt, even correctly signed
    assert not verify(key, ev.id, str(old), sign(key, ev.id, old, body), body)
    # one valid signature among several (secret rotation) verifies
    assert verify(key, ev.id, h[WEBHOOK_TIMESTAMP], "v1,bm9wZQ== " + h[WEBHOOK_SIGNATURE], body)


def test_the_signature_matches_the_spec_scheme():
    """HMAC-SHA256 over "{id}.{timestamp}.{body}" with the base64-decoded whsec_ key, base64, "v1," prefix."""
    import base64
    import hashlib
    import hmac

    raw_key = base64.b64decode(SECRET.removeprefix("whsec_"))
    body = b'{"type":"queued"}'
    want = base64.b64encode(hmac.new(raw_key, b"5-0.1674087231." + body, hashlib.sha256).digest()).decode()
    assert sign(secret_key(SECRET), "5-0", 1674087231, body) == f"v1,{want}"
    with pytest.raises(ValueError):
        secret_key("whsec_not*base64")
    with pytest.raises(ValueError):
        secret_key("")


def test_410_gone_stops_the_consumer_and_leaves_the_event_pending(r, redis_url, producer):
    from pagestream.producer.protocol.redis_conn import connect
    from pagestream.producer.webhook.consumer import EndpointGone, WebhookConsumer, WebhookSettings

    class Gone(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            self.send_response(410)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gone)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = connect(redis_url, decode_responses=True)
    try:
        job = producer.submit(prompt="nobody wants this", max_tokens=1)
        settings = WebhookSettings(url=f"http://127.0.0.1:{server.server_port}/", secret=SECRET, group="g410",
                                   consumer="c410", start_id="0", block_ms=100)
        with pytest.raises(EndpointGone):
            WebhookConsumer(client, settings).run()
        assert _pending_of(r, "g410") == {"c410": 1}  # read, not acked: a later start delivers it
        assert [e.job for e in producer.events()] == [job]
    finally:
        client.close()
        server.shutdown()
        server.server_close()


def test_events_trimmed_before_the_group_read_them_are_reported(r, redis_url, producer, monkeypatch, caplog):
    from pagestream.producer.protocol.events import events_maxlen
    from pagestream.producer.protocol.redis_conn import connect
    from pagestream.producer.webhook.consumer import WebhookConsumer, WebhookSettings

    client = connect(redis_url, decode_responses=True)
    wc = WebhookConsumer(client, WebhookSettings(url="http://127.0.0.1:9/", secret=SECRET, group="slow", start_id="0"))
    wc.ensure_group()
    wc._check_trimmed()
    assert "trimmed before group slow read them" not in caplog.text  # nothing lost yet
    monkeypatch.setenv("PAGESTREAM_EVENTS_MAXLEN", "100")
    events_maxlen.cache_clear()
    try:
        producer.submit_many([{"prompt": f"p{i}", "max_tokens": 1} for i in range(1500)])
    finally:
        monkeypatch.delenv("PAGESTREAM_EVENTS_MAXLEN")
        events_maxlen.cache_clear()
    wc._check_trimmed()
    assert "trimmed before group slow read them" in caplog.text
    client.close()
