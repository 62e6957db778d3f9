"""The ``pagestream`` command line.

Only ``worker`` imports the engine (inside the command), so ``submit``, ``tail``,
``stats`` and ``bulk`` work in a producer-only install without torch.

Exit status: 0 done, 1 the job or bulk did not complete, 2 bad input or not found,
3 Redis unreachable (one line on stderr, no traceback): see ``producer/protocol/cli.py``.
"""
from __future__ import annotations

import json
import logging
import sys
from typing import Optional

import typer

from pagestream.producer.protocol.redaction import install_log_redaction, redact, redact_url
from pagestream.producer.protocol.cli import EXIT_REDIS_DOWN, redis_url_option, resolve_url
from pagestream.worker.engine_options import engine_kwargs, with_engine_options

app = typer.Typer(add_completion=False, no_args_is_help=True, help="pagestream: queue-fed LLM batch inference.")

RedisUrl = redis_url_option()
#: the worker process's GIL switch interval (``sys.setswitchinterval``; Python's default is 5 ms)
GIL_SWITCH_INTERVAL_S = 0.001
_url = resolve_url


def _version(value: bool) -> None:
    if value:
        from pagestream import __version__

        typer.echo(f"pagestream {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version and exit"),
) -> None:
    """pagestream: queue-fed LLM batch inference."""


def _wopt(flag: str, field: str, help: str, default: str):
    """A worker option that overrides ``WorkerSettings.<field>``; ``--help`` shows its env name and default."""
    return typer.Option(None, flag, envvar=f"PAGESTREAM_{field.upper()}", show_envvar=True, show_default=default, help=help)


def build_engine(settings) -> object:
    """The engine a worker drives: ``--model fake[:step_ms]`` is the instant fake (tests, benchmarks).

    Resolves ``settings.max_num_seqs`` to what the engine took, so the worker reads as many jobs."""
    model = settings.model
    if not model:
        raise typer.BadParameter("--model is required (an HF model directory, or 'fake')")
    if model == "fake" or model.startswith("fake:"):
        from pagestream.worker.fake_engine import FakeConfig, FakeEngine

        delay_ms = float(model.split(":", 1)[1]) if ":" in model else 0.0
        settings.max_num_seqs = settings.max_num_seqs or FakeConfig.max_num_seqs
        return FakeEngine(FakeConfig(max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len or 512, step_delay_s=delay_ms / 1000))
    import torch

    from pagestream.engine import EngineConfig, LLMEngine

    device = settings.device or "auto"
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    knobs = engine_kwargs(settings)
    knobs.setdefault("max_num_seqs", 512 if on_gpu else 8)
    try:
        config = EngineConfig(model=model, **knobs)
        if settings.engine_process if settings.engine_process is not None else on_gpu:
            from pagestream.engine.engine_process import EngineProcess

            engine = EngineProcess(config)
        else:
            engine = LLMEngine(config)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    settings.max_num_seqs = engine.config.max_num_seqs
    return engine


@app.command()
@with_engine_options()
def worker(
    redis_url: Optional[str] = RedisUrl,
    model: Optional[str] = _wopt("--model", "model", "HF model directory, or 'fake[:step_ms]' (the instant fake engine)", "none (required)"),
    served_model_name: Optional[str] = _wopt("--served-model-name", "served_model_name",
                                             "announce this model and take only its jobs", "none: the shared lanes"),
    engine_process: Optional[bool] = typer.Option(
        None, "--engine-process/--no-engine-process", envvar="PAGESTREAM_ENGINE_PROCESS", show_envvar=True,
        show_default="on with CUDA, off on the CPU",
        help="run the engine core in its own process, so queue work never holds the GIL its step needs"),
    consumer: Optional[str] = _wopt("--consumer", "consumer", "consumer name in the group (unique per worker)", "host-pid"),
    lanes: Optional[str] = _wopt("--lanes", "lanes", "comma-separated subset of high,normal,low", "high,normal,low"),
    lease_ms: Optional[int] = _wopt("--lease-ms", "lease_ms",
                                    "an entry idle this long in a dead worker's PEL is reclaimed by another", "30000"),
    max_deliveries: Optional[int] = _wopt("--max-deliveries", "max_deliveries",
                                          "deliveries of one job before it is dead-lettered", "3"),
    drain_timeout: Optional[float] = _wopt("--drain-timeout", "drain_timeout_s", "seconds a warm stop may take", "30"),
    prefetch: Optional[int] = _wopt("--prefetch", "prefetch", "entries read beyond what the engine can admit now", "2"),
    publish_interval_ms: Optional[float] = _wopt("--publish-interval-ms", "publish_interval_ms",
                                                 "a job's tokens are coalesced this long before they are written", "20"),
    burst: bool = typer.Option(False, "--burst", help="exit when the queue is empty"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", envvar="PAGESTREAM_METRICS_PORT", show_envvar=True, show_default="none", help="serve Prometheus metrics (only /metrics) on this port"),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", envvar="PAGESTREAM_METRICS_HOST", show_envvar=True,
                                     help="address the metrics endpoint binds (0.0.0.0 in a container)"),
    log_level: str = typer.Option("INFO", "--log-level", envvar="PAGESTREAM_LOG_LEVEL", show_envvar=True,
                                  help="DEBUG | INFO | WARNING | ERROR"),
    engine_options: dict | None = None,
) -> None:
    """Run a worker: pull jobs from the lanes into the engine, stream tokens back (every engine knob is an option)."""
    from pagestream.engine.errors import EngineDeadError
    from pagestream.producer.protocol.redis_conn import connect
    from pagestream.worker.settings import WorkerSettings
    from pagestream.engine.heap import freeze_startup_heap
    from pagestream.worker.worker import Worker

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    # The loop thread hands the GIL over at every wait (Redis, the engine core's pipe) and must get it
    # back from the publisher thread, which keeps it up to a whole switch interval (5 ms by default).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    overrides = {
        "redis_url": redis_url, "model": model, "served_model_name": served_model_name, "consumer": consumer,
        "lanes": lanes, "lease_ms": lease_ms, "max_deliveries": max_deliveries, "drain_timeout_s": drain_timeout,
        "prefetch": prefetch, "publish_interval_ms": publish_interval_ms, "engine_process": engine_process,
        **(engine_options or {}),
    }
    settings = WorkerSettings(**{k: v for k, v in overrides.items() if v is not None})
    engine = build_engine(settings)
    client = connect(settings.redis_url, health_check_interval=30)  # a single node or any node of a cluster
    w = Worker(client, engine, settings)
    freeze_startup_heap()  # the engine's objects (or, with an engine process, torch's) live as long as the worker
    if metrics_port:
        w.metrics.watch_engine(engine)
        w.metrics.serve(metrics_port, metrics_host)
    logging.getLogger("pagestream").info("worker %s ready on %s (lanes %s)", settings.consumer, redact_url(settings.redis_url), settings.lanes)
    from pagestream.worker.routing import start_announcer

    from pagestream.worker.tokenizer_service import start_tokenizer_service

    announcer = start_announcer(client, settings, engine)
    tokenizer_service = start_tokenizer_service(client, settings, engine)  # the gateway's /tokenize, /detokenize
    print(f"worker {settings.consumer} ready", flush=True)
    try:
        w.run(burst=burst)
    except EngineDeadError as exc:  # its jobs were handed back for other workers; say why in one line
        logging.getLogger("pagestream").error("worker %s stopped: %s", settings.consumer, exc)
        raise typer.Exit(1) from None
    finally:
        if announcer is not None:
            announcer.stop()
        if tokenizer_service is not None:
            tokenizer_service.stop()
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    print(f"worker {settings.consumer} stopped after {w.num_steps} steps, {w.num_completed} jobs", flush=True)


@app.command()
def stats(
    redis_url: Optional[str] = RedisUrl,
    as_json: bool = typer.Option(False, "--json", help="print the figures as JSON"),
    window_s: int = typer.Option(10, "--window", help="seconds over which jobs/s is averaged"),
) -> None:
    """Per lane: length, pending, consumers and their idle time, DLQ size, jobs/s."""
    from pagestream.producer.protocol.redis_conn import connect
    from pagestream.worker.stats import collect_stats, format_stats

    client = connect(_url(redis_url))
    data = collect_stats(client, window_s=window_s)
    typer.echo(json.dumps(data, indent=2) if as_json else format_stats(data))


@app.command()
def top(
    redis_url: Optional[str] = RedisUrl,
    interval: float = typer.Option(1.0, "--interval", min=0.1, help="seconds between frames"),
    once: bool = typer.Option(False, "--once", help="print one frame and exit (for scripts)"),
) -> None:
    """Live view: queue depth and oldest job per model and lane, workers (running, KV, tokens/s, heartbeat),
    recent failures. Ctrl-C quits."""
    from pagestream.worker.top import run_top

    run_top(_url(redis_url), interval_s=interval, once=once)


try:  # the bulk commands live with the bulk path (producer/bulk/cli.py)
    from pagestream.producer.bulk.cli import bulk_app, bulk_worker

    app.add_typer(bulk_app, name="bulk")
    app.command("bulk-worker")(bulk_worker)
except ImportError:
    pass

from pagestream.producer.gateway.cli import gateway  # noqa: E402  (the OpenAI-compatible server)
from pagestream.worker.serve_cli import serve  # noqa: E402

app.command("gateway")(gateway)
app.command("serve")(serve)

from pagestream.producer.client.cli import cancel, dlq_app, events, status, submit, tail  # noqa: E402  (the client's commands)

app.command("submit")(submit)
app.command("tail")(tail)
app.command("cancel")(cancel)
app.command("status")(status)
app.command("events")(events)
app.add_typer(dlq_app, name="dlq")

from pagestream.producer.webhook.cli import webhook  # noqa: E402  (the event firehose to a URL)

app.command("webhook")(webhook)


def main() -> None:
    """The ``pagestream`` entry point: ``app`` with Redis being unreachable said in one line, and a
    quiet exit (``worker/quiet_exit.py``)."""
    import redis

    from pagestream.worker.quiet_exit import quiet_exit

    code: object = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code
    except (redis.ConnectionError, redis.TimeoutError, ConnectionError) as exc:  # builtin: a producer read gave up
        cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""  # the producer's give-up names the job, its cause the server
        typer.echo(f"error: cannot reach Redis: {redact(str(exc) + cause)}", err=True)
        code = EXIT_REDIS_DOWN
    quiet_exit(code)  # a worker loaded triton: leave without nanobind's refleak report


if __name__ == "__main__":
    main()
