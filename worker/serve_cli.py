"""``pagestream serve MODEL``: everything one machine needs in one command: the gateway, a worker for
MODEL, a bulk-worker (the Batch API's orchestrator) and an embedded Redis when none is configured
(``pagestream gateway``, the HTTP server alone, lives with the gateway: ``producer/gateway/cli.py``).

It does not import the engine: it runs the worker as a child process
(``pagestream worker --served-model-name M``) so the gateway's event loop and the
engine's step never share a GIL, and the bulk-worker as another (``pagestream bulk-worker``:
RQ's worker wants the main thread for its signal handlers).

Readiness is read from Redis, where the worker says it itself: its heartbeat hash
(``keys.worker_hash(consumer)``, refreshed every second by its control thread once its loop runs)
and its model announcement (``keys.model_registry()``): not from its log.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Optional

import typer

from pagestream.producer.gateway.cli import (ApiKeys, EnableAutoToolChoice, Host, MaxQueueDepth, Port, RedisUrl, ToolCallParser,
                                            TrustRequestChatTemplate, EnablePromptTokensDetails,
                                            EnableTokenizerInfoEndpoint, gateway_settings)
from pagestream.producer.protocol.redaction import install_log_redaction, redact_url
from pagestream.worker.engine_options import engine_flags, with_engine_options
from pagestream.worker.readiness import wait_ready

#: how long a worker may take to load its model before ``serve`` gives up
def resolve_model(model: str) -> str:
    """A local directory as given, ``fake[:ms]``, or a hub id found in the local Hugging Face cache."""
    if model == "fake" or model.startswith("fake:") or Path(model).expanduser().is_dir():
        return str(Path(model).expanduser()) if Path(model).expanduser().is_dir() else model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception as exc:  # not a directory, not in the cache, or no huggingface_hub
        raise typer.BadParameter(f"{model!r} is neither a model directory nor a hub id in the local Hugging Face cache ({exc})",
                                 param_hint="MODEL") from None


def _free_port() -> int:
    """A loopback port nothing listens on now (the worker binds it a moment later)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _forward(stream: IO[str], tag: str) -> threading.Thread:
    """Copy a child's output to ours, each line tagged with what it came from."""

    def pump() -> None:
        for line in stream:
            sys.stdout.write(f"[{tag}] {line}")
            sys.stdout.flush()

    t = threading.Thread(target=pump, name=f"forward-{tag}", daemon=True)
    t.start()
    return t


def _stop_children(children: list[tuple[str, subprocess.Popen | None, float]]) -> None:
    """SIGTERM every child at once (each drains in parallel), then wait for each up to its own bound and
    kill it past that: the whole stop takes the longest bound, not their sum."""
    log = logging.getLogger("pagestream.serve")
    running = [(name, proc, time.monotonic() + bound) for name, proc, bound in children if proc is not None and proc.poll() is None]
    for name, proc, _ in running:
        log.info("stopping the %s (pid %d)", name, proc.pid)
        proc.send_signal(signal.SIGTERM)
    for name, proc, deadline in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("the %s (pid %d) did not stop in time: killed", name, proc.pid)
            proc.kill()
            proc.wait()


@with_engine_options(with_env=False)
def serve(
    model_arg: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False,
                                              help="HF model directory, a hub id in the local HF cache, or 'fake'"),
    model: Optional[str] = typer.Option(None, "--model", show_default="MODEL", help="MODEL as an option (an alias of the argument)"),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", show_default="MODEL as given", help="the name clients use"),
    redis_url: Optional[str] = RedisUrl,
    host: str = Host,
    port: int = Port,
    api_keys: Optional[str] = ApiKeys,
    max_queue_depth: Optional[int] = MaxQueueDepth,
    enable_auto_tool_choice: bool = EnableAutoToolChoice,
    tool_call_parser: Optional[str] = ToolCallParser,
    trust_request_chat_template: bool = TrustRequestChatTemplate,
    enable_prompt_tokens_details: bool = EnablePromptTokensDetails,
    enable_tokenizer_info_endpoint: bool = EnableTokenizerInfoEndpoint,
    files_uri: Optional[str] = typer.Option(None, "--files-uri", envvar="PAGESTREAM_GATEWAY_FILES_URI", show_envvar=True,
                                            show_default="~/.cache/pagestream/files",
                                            help="where /v1/files keeps uploads and batch outputs (a directory or s3://bucket/prefix)"),
    bulk_worker: bool = typer.Option(True, "--bulk-worker/--no-bulk-worker",
                                     help="run a bulk-worker too (the Batch API needs one somewhere)"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", envvar="PAGESTREAM_METRICS_PORT", show_envvar=True,
                                               show_default="a free loopback port",
                                               help="the worker serves Prometheus metrics (only /metrics) on this port; the "
                                                    "gateway's /metrics carries them too"),
    drain_timeout: Optional[float] = typer.Option(None, "--drain-timeout", show_default="30",
                                                  help="seconds the worker's warm stop may take"),
    log_level: str = typer.Option("WARNING", "--log-level", help="DEBUG | INFO | WARNING | ERROR"),
    engine_options: dict | None = None,
) -> None:
    """One-command server: gateway + a worker for MODEL + a bulk-worker (+ an embedded Redis when none is configured)."""
    from pagestream.producer.gateway.app import run
    from pagestream.producer.protocol.redis_conn import connect
    from pagestream.worker.demo import _stop, ensure_redis

    if model_arg and model and model_arg != model:
        raise typer.BadParameter(f"MODEL {model_arg!r} and --model {model!r} differ: give one", param_hint="MODEL")
    model = model_arg or model
    if not model:
        raise typer.BadParameter("give the model to serve: pagestream serve MODEL", param_hint="MODEL")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    name = served_model_name or model
    path = resolve_model(model)
    embedded = None
    if redis_url is None:
        redis_url, embedded = ensure_redis(announce=False)
    settings = gateway_settings(redis_url, host, port, api_keys, max_queue_depth, enable_auto_tool_choice,
                                tool_call_parser, trust_request_chat_template, enable_prompt_tokens_details,
                                enable_tokenizer_info_endpoint)
    if files_uri:
        settings.files_uri = files_uri
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    consumer = f"serve-{os.uname().nodename}-{os.getpid()}"
    cmd = [sys.executable, "-m", "pagestream.worker.cli", "worker", "--redis-url", redis_url, "--model", path,
           "--served-model-name", name, "--consumer", consumer, "--log-level", log_level]
    # the worker always serves its metrics (on a free loopback port unless one is given), and the gateway's
    # /metrics appends them to its own: one scrape of the one machine has the queue, the requests and the engine
    metrics_port = metrics_port or _free_port()
    cmd += ["--metrics-port", str(metrics_port)]
    metrics_host = os.environ.get("PAGESTREAM_METRICS_HOST") or "127.0.0.1"  # what the worker binds (worker --metrics-host)
    if metrics_host in ("0.0.0.0", "::"):
        metrics_host = "127.0.0.1"
    settings.worker_metrics_url = f"http://{metrics_host}:{metrics_port}/metrics"
    if drain_timeout is not None:
        cmd += ["--drain-timeout", str(drain_timeout)]
    cmd += engine_flags(engine_options or {})  # the worker's engine knobs, as given here
    worker = bulk = None
    try:
        if bulk_worker:
            bulk = subprocess.Popen([sys.executable, "-m", "pagestream.worker.cli", "bulk-worker", "--redis-url", redis_url,
                                     "--name", f"{consumer}-bulk"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            _forward(bulk.stdout, "bulk-worker")
        worker = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        _forward(worker.stdout, "worker")
        client = connect(redis_url)
        try:
            wait_ready(client, consumer, name, worker)
        except RuntimeError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        finally:
            client.close()
        if bulk is not None and bulk.poll() is not None:
            typer.echo(f"error: the bulk-worker exited (status {bulk.returncode})", err=True)
            raise typer.Exit(1)
        device = (engine_options or {}).get("device") or "auto"
        banner = "\n".join([
            f"pagestream serve: {name!r} ready",
            f"  gateway      http://{settings.host}:{settings.port}/v1 (OpenAI API: models, completions, chat, files, batches)",
            f"  redis        {redact_url(redis_url)}{' (embedded, stopped with serve)' if embedded is not None else ''}",
            f"  worker       pid {worker.pid}, consumer {consumer}, model {path} on {device}"
            + f", metrics on :{metrics_port}/metrics (and on the gateway's /metrics)",
            "  bulk-worker  " + (f"pid {bulk.pid} (runs /v1/batches)" if bulk is not None else "not started (--no-bulk-worker): batches wait for one"),
            f"  files        {settings.files_uri}",
        ])
        # run() turns the SIGTERM uvicorn re-raises after its shutdown into SystemExit(0), so the finally
        # below stops the children and the Redis
        # "ready" only once the gateway listens (its startup warms the grammar check first): a client that
        # reads the banner and connects at once is answered, not refused
        run(settings, on_started=lambda: print(banner, flush=True))
    finally:
        _stop_children([("worker", worker, (drain_timeout or 30.0) + 30.0), ("bulk-worker", bulk, 30.0)])
        _stop(embedded)
