"""``pagestream webhook --url URL --secret S``: the event firehose POSTed to a URL (``producer/webhook/consumer.py``).

No torch here; ``worker/cli.py`` mounts it with ``app.command("webhook")(webhook)``.
"""
from __future__ import annotations

import logging
import signal
from typing import Optional

import typer

from pagestream.producer.protocol.cli import EXIT_FAILED, fail, redis_url_option, resolve_url
from pagestream.producer.protocol.redaction import install_log_redaction, redact_url
from pagestream.producer.webhook.consumer import DEFAULT_GROUP, ENV_PREFIX


def _env(name: str) -> str:
    return f"{ENV_PREFIX}{name.upper()}"


def webhook(
    url: Optional[str] = typer.Option(None, "--url", envvar=_env("url"), show_envvar=True, show_default="required",
                                      help="where each event is POSTed as JSON"),
    secret: Optional[str] = typer.Option(None, "--secret", envvar=_env("secret"), show_envvar=True, show_default="required",
                                         help="signing secret: whsec_<base64> (Standard Webhooks) or any string "
                                              "(its UTF-8 bytes); prefer the env var to the command line"),
    group: Optional[str] = typer.Option(None, "--group", envvar=_env("group"), show_envvar=True, show_default=DEFAULT_GROUP,
                                        help="consumer group on the events stream (one per destination)"),
    consumer: Optional[str] = typer.Option(None, "--consumer", envvar=_env("consumer"), show_envvar=True,
                                           show_default="webhook-<hostname>",
                                           help="this consumer's name in the group (a restart under the same name "
                                                "re-delivers its unacked events at once)"),
    start_id: Optional[str] = typer.Option(None, "--from", envvar=_env("start_id"), show_envvar=True, show_default="$",
                                           help="where a new group starts: $ (events from now) or 0 (every event kept)"),
    claim_idle_ms: Optional[int] = typer.Option(None, "--claim-idle-ms", envvar=_env("claim_idle_ms"), show_envvar=True,
                                                show_default="60000",
                                                help="take over another consumer's events pending this long (XAUTOCLAIM)"),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", envvar=_env("concurrency"), show_envvar=True,
                                              show_default="8", help="deliveries in flight at once (a job's events in order)"),
    timeout_s: Optional[float] = typer.Option(None, "--timeout", envvar=_env("timeout_s"), show_envvar=True,
                                              show_default="15", help="seconds per HTTP attempt"),
    backoff_base_s: Optional[float] = typer.Option(None, "--backoff-base", envvar=_env("backoff_base_s"), show_envvar=True,
                                                   show_default="0.5", help="seconds before the first retry, doubling each time"),
    backoff_cap_s: Optional[float] = typer.Option(None, "--backoff-cap", envvar=_env("backoff_cap_s"), show_envvar=True,
                                                  show_default="60", help="longest wait between two attempts, in seconds"),
    redis_url: Optional[str] = redis_url_option(),
    log_level: str = typer.Option("INFO", "--log-level", envvar="PAGESTREAM_LOG_LEVEL", show_envvar=True,
                                  help="DEBUG | INFO | WARNING | ERROR"),
) -> None:
    """POST every job event to --url (Standard Webhooks headers and signature), retrying until a 2xx; resumes from its group."""
    from pydantic import ValidationError

    from pagestream.producer.protocol.redis_conn import outage_proof
    from pagestream.producer.webhook.consumer import EndpointGone, WebhookConsumer, WebhookSettings

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    given = {"url": url, "secret": secret, "group": group, "consumer": consumer, "start_id": start_id,
             "claim_idle_ms": claim_idle_ms, "concurrency": concurrency, "timeout_s": timeout_s,
             "backoff_base_s": backoff_base_s, "backoff_cap_s": backoff_cap_s}
    try:
        settings = WebhookSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    url_ = resolve_url(redis_url)
    try:
        wc = WebhookConsumer(outage_proof(url_, decode_responses=True), settings)
    except ValueError as exc:  # the secret
        fail(str(exc))

    def warm_stop(signum, frame) -> None:
        wc.stop()

    signal.signal(signal.SIGTERM, warm_stop)
    signal.signal(signal.SIGINT, warm_stop)
    print(f"webhook {settings.consumer} of group {settings.group} on redis {redact_url(url_)} -> {redact_url(settings.url)}", flush=True)
    try:
        wc.run()
    except EndpointGone as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED)
    print(f"webhook {settings.consumer} stopped: {wc.stats.delivered} events delivered, "
          f"{wc.stats.failed_attempts} failed attempts", flush=True)
