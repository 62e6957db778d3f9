"""``pagestream serve``: gateway + one worker + an embedded Redis when none is configured, in one command
(``pagestream gateway``, the HTTP server alone, lives with the gateway: ``producer/gateway/cli.py``).

It does not import the engine: it runs the worker as a child process
(``pagestream worker --served-model-name M``) so the gateway's event loop and the
engine's step never share a GIL.
"""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import typer

from pagestream.producer.gateway.cli import ApiKeys, Host, MaxQueueDepth, Port, RedisUrl, gateway_settings
from pagestream.producer.protocol.redaction import install_log_redaction, redact_url
from pagestream.worker.engine_options import engine_flags, with_engine_options


def resolve_model(model: str) -> str:
    """A local directory as given, ``fake[:ms]``, or a hub id found in the local Hugging Face cache."""
    if model == "fake" or model.startswith("fake:") or Path(model).expanduser().is_dir():
        return str(Path(model).expanduser()) if Path(model).expanduser().is_dir() else model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception as exc:  # not a directory, not in the cache, or no huggingface_hub
        raise typer.BadParameter(f"{model!r} is neither a model directory nor a hub id in the local Hugging Face cache ({exc})",
                                 param_hint="--model") from None


@with_engine_options(with_env=False)
def serve(
    model: str = typer.Option(..., "--model", help="HF model directory, a hub id in the local HF cache, or 'fake'"),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", show_default="--model as given", help="the name clients use"),
    redis_url: Optional[str] = RedisUrl,
    host: str = Host,
    port: int = Port,
    api_keys: Optional[str] = ApiKeys,
    max_queue_depth: Optional[int] = MaxQueueDepth,
    log_level: str = typer.Option("WARNING", "--log-level", help="DEBUG | INFO | WARNING | ERROR"),
    engine_options: dict | None = None,
) -> None:
    """One-command server: gateway + a worker for MODEL (+ an embedded Redis when none is configured)."""
    from pagestream.producer.gateway.app import run
    from pagestream.worker.demo import _stop, ensure_redis

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    embedded = None
    if redis_url is None:
        redis_url, embedded = ensure_redis()
    name = served_model_name or model
    path = resolve_model(model)
    cmd = [sys.executable, "-m", "pagestream.worker.cli", "worker", "--redis-url", redis_url, "--model", path,
           "--served-model-name", name, "--log-level", log_level]
    cmd += engine_flags(engine_options or {})  # the worker's engine knobs, as given here
    worker = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in worker.stdout:  # wait for the engine to load
            if "ready" in line:
                break
            sys.stdout.write(f"[worker] {line}")
        if worker.poll() is not None:
            raise typer.Exit(1)
        threading.Thread(target=lambda: [sys.stdout.write(f"[worker] {ln}") for ln in worker.stdout], daemon=True).start()
        settings = gateway_settings(redis_url, host, port, api_keys, max_queue_depth)
        print(f"serving {name!r} on http://{settings.host}:{settings.port}/v1 (redis {redact_url(redis_url)})", flush=True)
        # uvicorn re-raises the SIGTERM it caught once it has shut down; as an exception (not the
        # default handler's instant exit) it lets the finally below stop the worker and the Redis.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        run(settings)
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(60)
            except subprocess.TimeoutExpired:
                worker.kill()
        _stop(embedded)
