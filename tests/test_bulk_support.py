"""Helpers for the bulk tests: moto server, a fault-injecting S3 proxy, a stand-in worker.

Also runnable as a script (``python tests/test_bulk_support.py standin ...``) so the
crash tests can ``kill -9`` a stand-in worker process.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {port}")


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, **AWS_ENV})
    wait_port(port)
    return proc, f"http://127.0.0.1:{port}"


class FaultRule:
    """Fail matching requests: ``times`` of them, with ``status`` (e.g. 500, 403), ``"timeout"``
    or ``"truncate"`` (forward, then drop the connection half-way through the body).

    ``after_forward=True`` forwards the request first and then fails (lost response).
    """

    def __init__(self, method: str, path_re: str, *, status: int | str = 500, times: int = 1,
                 query_re: str = "", after_forward: bool = False, code: str = "InternalError") -> None:
        self.method, self.path_re, self.query_re = method, re.compile(path_re), re.compile(query_re)
        self.status, self.times, self.after_forward, self.code = status, times, after_forward, code
        self.hits = 0

    def matches(self, method: str, path: str, query: str) -> bool:
        return (self.times != 0 and method == self.method and self.path_re.search(path) is not None
                and self.query_re.search(query) is not None)


class FaultProxy:
    """A threaded HTTP proxy in front of moto that injects S3 faults by rule."""

    def __init__(self, upstream: str, timeout_sleep_s: float = 3.0) -> None:
        self.upstream = upstream.replace("http://", "")
        self.rules: list[FaultRule] = []
        self.lock = threading.Lock()
        self.timeout_sleep_s = timeout_sleep_s
        self.log: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path, _, query = self.path.partition("?")
                rule = proxy._take(self.command, path, query)
                if rule is not None and not rule.after_forward:
                    return self._fault(rule)
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if rule is not None and rule.status != "truncate":
                    return self._fault(rule)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if rule is not None:  # "truncate": the connection drops half-way through the body
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _fault(self, rule: FaultRule):
                if rule.status == "timeout":
                    time.sleep(proxy.timeout_sleep_s)
                    self.close_connection = True
                    return
                xml = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{rule.code}</Code>"
                       f"<Message>injected</Message></Error>").encode()
                self.send_response(int(rule.status))
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(xml)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(xml)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _take(self, method: str, path: str, query: str) -> FaultRule | None:
        with self.lock:
            for rule in self.rules:
                if rule.matches(method, path, query):
                    rule.times -= 1
                    rule.hits += 1
                    self.log.append(f"{method} {path}?{query} -> {rule.status}")
                    return rule
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- stand-in worker: reads bulk jobs off the lane stream and feeds the real BulkSink ------------

def fake_text(job) -> str:
    """The fake engine: deterministic text derived from the request."""
    src = job.prompt if job.prompt is not None else job.messages[-1].content
    return f"echo:{src[::-1][:24]}"


def run_standin(redis_url: str, consumer: str, lanes=("low",), *, stop: threading.Event | None = None,
                max_idle_s: float | None = None, flush_lines: int = 64, flush_interval_s: float = 0.5,
                s3_endpoint_url: str | None = None, count: int = 64, fail_prompt: str | None = None,
                delay_s: float = 0.0) -> int:
    """A worker stand-in: XREADGROUP, fake engine, ``BulkSink`` add/poll, XACK what poll returns."""
    import redis as redis_lib

    from pagestream.producer.protocol import keys
    from pagestream.producer.protocol.schema import JobRequest, JobResult, JobStatus
    from pagestream.worker.bulk_sink import BulkSink

    class S:
        bulk_flush_lines = flush_lines
        bulk_flush_interval_s = flush_interval_s

    S.s3_endpoint_url = s3_endpoint_url
    r = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    streams = {keys.jobs_stream(lane): ">" for lane in lanes}
    for s in streams:
        try:
            r.xgroup_create(s, keys.DEFAULT_GROUP, id="0", mkstream=True)
        except redis_lib.ResponseError:
            pass
    sink = BulkSink(r, consumer, S())
    acked = 0
    idle_since = time.time()
    while not (stop is not None and stop.is_set()):
        # Reclaim what a dead consumer left behind, then read new entries.
        resp = []
        for s in streams:
            _, claimed, _ = r.xautoclaim(s, keys.DEFAULT_GROUP, consumer, min_idle_time=3000, count=count)
            if claimed:
                resp.append((s, claimed))
        resp += r.xreadgroup(keys.DEFAULT_GROUP, consumer, streams, count=count, block=100) or []
        got = False
        for stream, entries in resp:
            lane = stream.rsplit(":", 1)[1]
            for entry_id, fields in entries:
                if not fields:
                    continue
                got = True
                job = JobRequest.model_validate_json(fields["job"])
                if fail_prompt is not None and job.prompt == fail_prompt:
                    res = JobResult(job_id=job.job_id, status=JobStatus.FAILED, error="engine exploded")
                else:
                    res = JobResult(job_id=job.job_id, status=JobStatus.COMPLETED, text=fake_text(job),
                                    finish_reason="length", prompt_tokens=3, completion_tokens=4)
                sink.add(lane, entry_id, job, res)
        if got and delay_s:
            time.sleep(delay_s)
        done = sink.poll()
        for lane, entry_id in done:
            r.xack(keys.jobs_stream(lane), keys.DEFAULT_GROUP, entry_id)
        acked += len(done)
        if got or len(sink):
            idle_since = time.time()
        elif max_idle_s is not None and time.time() - idle_since > max_idle_s:
            break
    for lane, entry_id in sink.close():
        r.xack(keys.jobs_stream(lane), keys.DEFAULT_GROUP, entry_id)
        acked += 1
    return acked


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["standin"])
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--consumer", required=True)
    ap.add_argument("--flush-lines", type=int, default=64)
    ap.add_argument("--flush-interval-s", type=float, default=0.5)
    ap.add_argument("--max-idle-s", type=float, default=None)
    ap.add_argument("--s3-endpoint-url", default=None)
    ap.add_argument("--delay-s", type=float, default=0.0, help="sleep per read batch (slow fake engine)")
    args = ap.parse_args()
    print(json.dumps({"acked": run_standin(args.redis_url, args.consumer, flush_lines=args.flush_lines,
                                            flush_interval_s=args.flush_interval_s, max_idle_s=args.max_idle_s,
                                            s3_endpoint_url=args.s3_endpoint_url, delay_s=args.delay_s)}))
