"""Bounded everything (issue 22): uploads counted while they stream, multipart limits, strict query
parameters, against a gateway process (no worker needed: nothing here reaches one)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

import httpx
import pytest

from gateway_helpers import DB_URL, GatewayProc

MAX_FILE = 1024 * 1024
HEADER_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 32


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = GatewayProc(DB_URL, log_dir=tmp_path_factory.mktemp("bounds"),
                    env={"PAGESTREAM_GATEWAY_FILES_URI": str(tmp_path_factory.mktemp("files")),
                         "PAGESTREAM_GATEWAY_MAX_FILE_BYTES": str(MAX_FILE),
                         "PAGESTREAM_GATEWAY_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
                         "PAGESTREAM_GATEWAY_MAX_CONNECTIONS": str(MAX_CONNECTIONS)})
    try:
        g.wait_ready()
        yield g
    finally:
        g.stop()


def test_a_chunked_upload_is_refused_once_it_passes_the_limit_not_after_it_ends(gw):
    """3 MiB of a file sent chunked (no content-length) and the body left open: the 413 arrives while
    the client could still be sending, so the gateway never waited for (or spooled) the whole body."""
    boundary = "xyzzy"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=15) as s:
        s.sendall(f"POST /v1/files HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                  f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n".encode())
        chunk = b"x" * 65536
        s.sendall(b"%x\r\n%s\r\n" % (len(head), head))
        for _ in range(3 * MAX_FILE // len(chunk)):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        answer = b""
        while b"\r\n\r\n" not in answer or b"}}" not in answer:
            data = s.recv(65536)  # main waited for the body's end here: a timeout
            if not data:
                break
            answer += data
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert f"larger than {MAX_FILE} bytes".encode() in answer
    assert b'"code":"file_too_large"' in answer
    assert gw.healthy()


def test_a_form_of_20000_fields_is_a_4xx_not_a_reset(gw):
    body = "&".join(f"f{i}=v" for i in range(20_000))
    fields = [(f"f{i}", (None, b"v")) for i in range(20_000)]
    r = httpx.post(f"{gw.base_url}/files", files=fields, timeout=30)
    assert 400 <= r.status_code < 500 and "error" in r.json()
    r = httpx.post(f"{gw.base_url}/files", content=body, headers={"content-type": "application/x-www-form-urlencoded"},
                   timeout=30)
    assert 400 <= r.status_code < 500 and "error" in r.json()
    assert gw.healthy()


@pytest.mark.parametrize("raw", ["١٢", "1_0", "²", " 5", "5 ", "+5", "0x10", "1e3", "", "-1", "0", "99999999999"])
@pytest.mark.parametrize("path", ["/files", "/batches"])
def test_integer_query_parameters_are_ascii_digits_only(gw, path, raw):
    r = httpx.get(f"{gw.base_url}{path}", params={"limit": raw}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "limit"


def test_a_connection_that_never_finishes_its_headers_is_closed(gw):
    with socket.create_connection(("127.0.0.1", gw.port), timeout=HEADER_TIMEOUT_S + 10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the gateway (main held it open for ever: a timeout here)
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 3
    assert gw.healthy()


def test_headers_past_max_header_bytes_are_a_400_and_the_connection_closes(gw):
    """16 KiB of request line and headers by default (max_header_bytes): 8 KiB of cookie passes, 20 KiB is
    a 400 and a closed connection, sent in small pieces so no single read sees it all."""
    assert httpx.get(f"http://127.0.0.1:{gw.port}/health", headers={"cookie": "a" * 8192}, timeout=10).status_code == 200
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nCookie: ")
        answer = b""
        try:
            for _ in range(20):
                s.sendall(b"a" * 1024)
                time.sleep(0.01)
            s.sendall(b"\r\n\r\n")
        except OSError:  # closed while sending: the answer is already there
            pass
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    # a header line that never ends, after a first request on the same connection (no header timeout
    # then): refused once it passes the bound, not buffered for as long as the client sends
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nCookie: ")
        answer = b""
        try:
            for _ in range(20):  # 20 KiB, then nothing: the 400 must come without the line's end
                s.sendall(b"a" * 1024)
                time.sleep(0.005)
        except OSError:  # closed while sending
            pass
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert gw.healthy()


def test_connections_past_the_cap_get_a_503_and_the_gateway_recovers(gw):
    held = [socket.create_connection(("127.0.0.1", gw.port), timeout=10) for _ in range(MAX_CONNECTIONS + 4)]
    try:
        time.sleep(0.2)
        r = httpx.get(f"http://127.0.0.1:{gw.port}/health", timeout=10)
        assert r.status_code == 503
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert gw.healthy()



def test_health_is_not_held_while_bodies_of_a_million_objects_are_parsed(gw):
    """A 3.9 MB body of a million ``{}`` took ~1.3 s to parse and check on the event loop, and /health
    waited that long (~1 s); now bodies past 256 KiB are checked in a worker thread and one of more than
    100,000 arrays/objects is refused before it is built: /health answers at once, the body gets a 400."""
    import threading

    body = ("[" + ", ".join(["{}"] * 1_000_000) + "]").encode()
    assert 3_900_000 < len(body) < 4 * 1024 * 1024
    answers: list[int] = []

    def post() -> None:
        with httpx.Client(timeout=60) as c:
            for path in ("/completions", "/chat/completions", "/batches") * 3:
                r = c.post(f"{gw.base_url}{path}", content=body, headers={"content-type": "application/json"})
                answers.append((r.status_code, r.json()["error"]["type"]))

    poster = threading.Thread(target=post)
    latencies = []
    with httpx.Client(timeout=10) as c:
        c.get(f"http://127.0.0.1:{gw.port}/health")
        poster.start()
        while poster.is_alive():
            t0 = time.perf_counter()
            assert c.get(f"http://127.0.0.1:{gw.port}/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
    poster.join()
    assert answers == [(400, "invalid_request_error")] * 9
    assert len(latencies) > 10
    # a body parsed on the loop holds /health ~1.3 s, once per body; 0.5 s leaves room for a loaded machine
    # (make test runs 3 xdist processes on 2 cores). The flood bench measures the p99 (BENCHMARKS.md).
    assert max(latencies) < 0.5, sorted(latencies)[-5:]


def test_braces_inside_strings_are_not_counted_as_containers(gw):
    """A prompt of 300,000 ``{[`` is text, not 300,000 objects: the body passes the container bound and
    fails later, on the model (no worker serves it), while one of 100,001 real arrays is refused."""
    r = httpx.post(f"{gw.base_url}/completions", json={"model": "nobody", "prompt": '{["\\' * 300_000,
                                                       "max_tokens": 1}, timeout=30)
    assert "arrays and objects" not in r.text and r.status_code in (400, 404), r.text
    r = httpx.post(f"{gw.base_url}/completions", content=b'{"model": "m", "prompt": ' + b"[" * 100_001, timeout=30)
    assert r.status_code == 400 and "more than 100000 arrays and objects" in r.json()["error"]["message"], r.text


# ---- issue 37: work per request bounded, validation errors short ---------------------------------------

def _jobs_in(db_url: str) -> int:
    import redis

    with redis.Redis.from_url(db_url) as r:
        return sum(1 for _ in r.scan_iter(match="ps:job:*", count=1000))


def test_a_list_of_20000_prompts_is_a_400_naming_both_numbers_and_queues_nothing(gw):
    """80 kB of ``[[1], [1], ...]`` was a 503 after 23 s with 19,568 jobs left queued; now the count is
    checked before anything else (default 256 prompts x n per request)."""
    before = _jobs_in(DB_URL)
    t0 = time.perf_counter()
    r = httpx.post(f"{gw.base_url}/completions", json={"model": "m", "prompt": [[1]] * 20_000, "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert time.perf_counter() - t0 < 5.0  # was 23 s; 0.6 s on a quiet 2-core machine (the test), 2.6 s seen under load
    err = r.json()["error"]
    assert "20000" in err["message"] and "256" in err["message"] and err["param"] == "prompt", err
    assert _jobs_in(DB_URL) == before


def test_prompts_times_n_past_the_limit_is_a_400_naming_the_product(gw):
    r = httpx.post(f"{gw.base_url}/completions", json={"model": "m", "prompt": ["a"] * 100, "n": 4}, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "100 prompt(s) x n=4 = 400" in message and "256" in message, message


@pytest.mark.parametrize("body, says", [
    ({"model": "m", "messages": [{}] * 50_000}, "50000 messages"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 50_000}]},
     "50000 parts"),
    ({"model": "m", "messages": [{"role": "user", "content": "a"}],
      "tools": [{"type": "function", "function": {"name": "f"}}] * 1_000}, "1000 tools"),
])
def test_long_lists_are_refused_by_their_count_in_a_short_400(gw, body, says):
    """A million ``{}`` messages were a 9.8 s 400 whose body listed every item (3.7 MB at 100k)."""
    t0 = time.perf_counter()
    r = httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text[:500]
    assert time.perf_counter() - t0 < 3.0
    assert says in r.json()["error"]["message"] and len(r.content) < 1_000, r.text[:500]


def test_a_body_with_many_bad_items_answers_a_few_errors_and_a_count(gw):
    body = {"model": "m", "messages": [{"role": "user", "content": 7}] * 1_000}
    r = httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text[:500]
    message = r.json()["error"]["message"]
    assert "more error(s)" in message and len(r.content) < 2_000, message[:500]


def _checkers(pid: int) -> set[int]:
    """The gateway's body-checker processes: its children that multiprocessing spawned as workers."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                if b"spawn_main" in open(f"/proc/{entry}/cmdline", "rb").read():
                    found.add(int(entry))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            pass
    return found


def test_a_killed_body_checker_is_replaced_and_large_bodies_are_still_judged(gw):
    """Bodies past 256 KiB are judged in checker processes: killing them (OOM killer, an operator) costs
    no answer: the body in flight is judged in a thread, the next one in fresh checkers."""
    hostile = ("[" + ", ".join(["{}"] * 200_000) + "]").encode()
    fine = {"model": "nobody", "prompt": "a" * 400_000, "max_tokens": 1}  # parses; no worker serves the model

    def judged() -> tuple[int, str]:
        r = httpx.post(f"{gw.base_url}/completions", content=hostile, headers={"content-type": "application/json"},
                       timeout=60)
        return r.status_code, r.json()["error"]["message"]

    assert judged() == (400, "request body is not acceptable JSON: more than 100000 arrays and objects")
    first = _checkers(gw.proc.pid)
    assert first, "no checker process"
    for pid in first:
        os.kill(pid, signal.SIGKILL)
    for _ in range(3):
        assert judged() == (400, "request body is not acceptable JSON: more than 100000 arrays and objects")
    r = httpx.post(f"{gw.base_url}/completions", json=fine, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    again = _checkers(gw.proc.pid)
    assert again and not again & first, (first, again)
    assert gw.healthy()
