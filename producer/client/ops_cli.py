"""Operations commands: ``pagestream cancel|status JOB`` and ``pagestream dlq list|show|retry``.

No torch and no engine here; ``worker/cli.py`` mounts them. A job or dead letter that does
not exist is exit status 2 with one line on stderr (see ``producer/protocol/cli.py``).
"""
from __future__ import annotations

import datetime as dt
import json
from typing import Optional

import redis
import typer

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.redis_conn import connect
from pagestream.producer.protocol.cli import fail, redis_url_option, resolve_url


def _client(url: str | None) -> redis.Redis:
    return connect(resolve_url(url))


def _s(v) -> str | None:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def _when(ts: float | str | None) -> str:
    if ts in (None, ""):
        return "-"
    return dt.datetime.fromtimestamp(float(ts), dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def cancel(
    job_id: str = typer.Argument(..., help="the job to cancel"),
    redis_url: Optional[str] = redis_url_option(),
) -> None:
    """Cancel a job: a queued one ends at once, a running one before its next step."""
    from pagestream.producer import Producer

    with Producer(_client(redis_url)) as p:
        before = p.cancel(job_id)
    if before is None:
        fail(f"no job {job_id} (never submitted, or its result expired)")
    if before.is_final:
        typer.echo(f"{job_id}: already {before.value}")
    elif before.value == "queued":
        typer.echo(f"{job_id}: cancelled")
    else:
        typer.echo(f"{job_id}: cancel requested (was {before.value})")


def status(
    job_id: str = typer.Argument(..., help="the job to show"),
    redis_url: Optional[str] = redis_url_option(),
    as_json: bool = typer.Option(False, "--json", help="print the job's fields as JSON"),
) -> None:
    """A job's status, lane, times, worker and error."""
    state = {_s(k): _s(v) for k, v in _client(redis_url).hgetall(keys.job_hash(job_id)).items()}
    if not state:
        fail(f"no job {job_id} (never submitted, or its result expired)")
    result = json.loads(state["result"]) if state.get("result") else {}
    info = {
        "job_id": job_id, "status": state.get("status"), "lane": state.get("lane"), "bulk_id": state.get("bulk_id"),
        "created_at": state.get("created_at"), "finished_at": state.get("finished_at"), "worker": result.get("worker"),
        "finish_reason": result.get("finish_reason"), "error": result.get("error"),
        "prompt_tokens": result.get("prompt_tokens"), "completion_tokens": result.get("completion_tokens"),
    }
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    typer.echo(f"{job_id}  {info['status']}  lane={info['lane'] or '-'}  created {_when(info['created_at'])}"
               f"  finished {_when(info['finished_at'])}")
    for k in ("bulk_id", "worker", "finish_reason", "completion_tokens", "error"):
        if info[k] is not None:
            typer.echo(f"  {k}: {info[k]}")


dlq_app = typer.Typer(help="The dead-letter stream: jobs that were invalid or failed every delivery.",
                      no_args_is_help=True)


@dlq_app.command("list")
def dlq_list(
    redis_url: Optional[str] = redis_url_option(),
    count: int = typer.Option(20, "--count", min=1, help="how many, newest first"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per line"),
) -> None:
    """The newest dead letters: id, job, lane, deliveries, reason."""
    from pagestream.producer.client.dead_letters import list_dead_letters

    entries = list_dead_letters(_client(redis_url), count)
    for e in entries:
        d = e.summary()
        if as_json:
            typer.echo(json.dumps(d))
        else:
            typer.echo(f"{d['dlq_id']}  {d['job_id'] or '-'}  {d['lane'] or '-'}  x{d['deliveries']}  {d['reason']}")
    if not entries and not as_json:
        typer.echo("no dead letters", err=True)


@dlq_app.command("show")
def dlq_show(
    dlq_id: str = typer.Argument(..., help="dead-letter id (first column of `dlq list`)"),
    redis_url: Optional[str] = redis_url_option(),
) -> None:
    """One dead letter as JSON, payload included."""
    from pagestream.producer.client.dead_letters import DeadLetterNotFound, get_dead_letter

    try:
        entry = get_dead_letter(_client(redis_url), dlq_id)
    except DeadLetterNotFound as exc:
        fail(exc.args[0])
    typer.echo(json.dumps(entry.to_json(), indent=2))


@dlq_app.command("retry")
def dlq_retry(
    dlq_ids: list[str] = typer.Argument(..., help="dead-letter ids (first column of `dlq list`)"),
    redis_url: Optional[str] = redis_url_option(),
) -> None:
    """Put dead-lettered jobs back on their lane (same job id); prints each job id."""
    from pagestream.producer.client.dead_letters import DeadLetterNotFound, NotRetryable, retry_dead_letter

    client = _client(redis_url)
    for dlq_id in dlq_ids:
        try:
            typer.echo(retry_dead_letter(client, dlq_id))
        except (DeadLetterNotFound, NotRetryable) as exc:
            fail(exc.args[0])
