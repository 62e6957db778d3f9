"""The client's commands: ``pagestream submit PROMPT``, ``tail JOB``, ``cancel|status JOB``, ``events`` and ``dlq list|show|retry``.

No torch and no engine here; ``worker/cli.py`` (the ``pagestream`` root) mounts them. A job or dead letter that does
not exist is exit status 2 with one line on stderr (see ``producer/protocol/cli.py``).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import signal
import sys
import threading
from typing import List, Optional

import redis
import typer

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.redis_conn import connect
from pagestream.producer.protocol.schema import Lane
from pagestream.producer.protocol.cli import fail, redis_url_option, resolve_url
from pagestream.producer.protocol import job as job_hash
from pagestream.producer.protocol.job import JobField


RedisUrl = redis_url_option()


def _client(url: str | None) -> redis.Redis:
    return connect(resolve_url(url))


def _when(ts: float | str | None) -> str:
    if ts in (None, ""):
        return "-"
    return dt.datetime.fromtimestamp(float(ts), dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def submit(
    prompt: str = typer.Argument(..., help="the prompt (use --chat to send it as a user message)"),
    redis_url: Optional[str] = RedisUrl,
    max_tokens: int = typer.Option(64, "--max-tokens", help="most tokens to generate"),
    temperature: float = typer.Option(1.0, "--temperature", help="sampling temperature (0: greedy)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling: keep the smallest set of tokens with this much probability"),
    seed: Optional[int] = typer.Option(None, "--seed", show_default="none (unseeded)", help="sampling seed (a resumed job repeats its text exactly)"),
    lane: Lane = typer.Option(Lane.NORMAL, "--lane", help="priority lane: workers read high before normal before low"),
    job_id: Optional[str] = typer.Option(None, "--job-id", show_default="a new id", help="job id (submitting an existing id again is a no-op)"),
    chat: bool = typer.Option(False, "--chat", help="apply the model's chat template"),
    system: Optional[str] = typer.Option(None, "--system", show_default="none", help="system message (implies --chat)"),
    stream: bool = typer.Option(False, "--stream", help="print tokens live"),
    as_json: bool = typer.Option(False, "--json", help="print the final JobResult as JSON"),
    timeout: Optional[float] = typer.Option(None, "--timeout", show_default="no limit", help="seconds to wait for the result"),
    no_wait: bool = typer.Option(False, "--no-wait", help="print the job id and return"),
) -> None:
    """Submit one job; print its text (or the result as JSON)."""
    from pydantic import ValidationError

    from pagestream.producer import Producer
    from pagestream.producer.protocol.schema import format_validation_error

    fields: dict = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, lane=lane.value, job_id=job_id)
    if chat or system:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        fields["messages"] = msgs
    else:
        fields["prompt"] = prompt
    with Producer.from_url(resolve_url(redis_url)) as p:
        try:
            jid = p.submit(**fields)
        except ValidationError as exc:
            typer.echo(f"error: {format_validation_error(exc)}", err=True)
            raise typer.Exit(2)
        if no_wait:
            typer.echo(jid)
            return
        if stream:
            for ev in p.stream(jid, timeout=timeout):
                if not as_json:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
        res = p.result(jid, timeout=timeout)
        if as_json:
            typer.echo(res.model_dump_json())
        elif not stream:
            typer.echo(res.text)
        else:
            typer.echo("")
        if res.status.value != "completed":
            typer.echo(f"job {jid} {res.status.value}: {res.error}", err=True)
            raise typer.Exit(1)


def tail(
    job_id: str = typer.Argument(..., help="the job to follow"),
    redis_url: Optional[str] = RedisUrl,
    from_index: int = typer.Option(0, "--from-index", help="skip the tokens before this index (a subscriber resuming)"),
    as_json: bool = typer.Option(False, "--json", help="one TokenEvent JSON per line"),
    timeout: Optional[float] = typer.Option(None, "--timeout", show_default="no limit", help="seconds to wait for the next token"),
) -> None:
    """Follow a job's token stream until it ends."""
    from pagestream.producer import Producer
    from pagestream.producer.client.producer import JobNotFound

    with Producer.from_url(resolve_url(redis_url)) as p:
        try:
            for ev in p.stream(job_id, from_index=from_index, timeout=timeout):
                if as_json:
                    typer.echo(ev.model_dump_json())
                else:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
        except JobNotFound:
            typer.echo(f"error: no job {job_id}", err=True)
            raise typer.Exit(1)
        if not as_json:
            typer.echo("")
        st = p.status(job_id)
        typer.echo(f"[{job_id}: {st.value if st else 'unknown'}]", err=True)


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
    state = job_hash.decode(_client(redis_url).hgetall(keys.job_hash(job_id)))
    if not state:
        fail(f"no job {job_id} (never submitted, or its result expired)")
    F = JobField
    result = json.loads(state[F.RESULT]) if state.get(F.RESULT) else {}
    info = {
        "job_id": job_id, "status": state.get(F.STATUS), "lane": state.get(F.LANE), "bulk_id": state.get(F.BULK_ID),
        "created_at": state.get(F.CREATED_AT), "finished_at": state.get(F.FINISHED_AT), "worker": result.get("worker"),
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


def events(
    redis_url: Optional[str] = redis_url_option(),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep reading new events until Ctrl-C"),
    job: Optional[str] = typer.Option(None, "--job", show_default="every job", help="only this job's events"),
    types: Optional[List[str]] = typer.Option(None, "--type", show_default="every type",
                                              help="only events of this type (repeat for more): queued, started, "
                                                   "first_token, finished, failed, cancelled, dead_lettered, reclaimed, "
                                                   "resumed, bulk_progress, bulk_finished"),
    from_id: Optional[str] = typer.Option(None, "--from", show_default="0; with --follow, $",
                                          help="start after this event id (0: the oldest kept, $: from now)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per line: id, the event's fields, ts"),
) -> None:
    """The job-event firehose (ps:events): one line per event, oldest first. Ctrl-C quits."""
    from pagestream.producer import Producer
    from pagestream.producer.protocol.events import EventType

    try:
        for t in types or ():
            EventType(t)
    except ValueError:
        fail(f"unknown event type {t!r}; one of: {', '.join(e.value for e in EventType)}")
    start = from_id if from_id is not None else "$" if follow else "0"
    stopping = threading.Event()
    if follow:
        # Ctrl-C (or a TERM) ends the follow at its next read, within a second. The handler raises nothing: a
        # KeyboardInterrupt that lands in a finalizer is swallowed there ("Exception ignored"), and the loop went on.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopping.set())
    try:
        with Producer(_client(redis_url)) as p:
            for ev in p.events(from_id=start, job=job, types=types or None, follow=follow, stop=stopping.is_set):
                typer.echo(json.dumps({"id": ev.id, **ev.fields, "ts": ev.ts}) if as_json else _event_line(ev))
    except KeyboardInterrupt:
        pass  # Ctrl-C: the way out of --follow, not an error
    except BrokenPipeError:  # `pagestream events | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _event_line(ev) -> str:
    """``ID  TIME  TYPE  SUBJECT  key=value ...``: the subject is the job, or a bulk event's bulk."""
    from pagestream.producer.protocol.events import EventField

    subject_key = EventField.JOB if ev.job else EventField.BULK
    when = dt.datetime.fromtimestamp(ev.ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    rest = " ".join(f"{k}={v}" for k, v in ev.fields.items()
                    if k not in (EventField.TYPE, EventField.JOB, EventField.TS, subject_key))
    kind = getattr(ev.type, "value", ev.type)
    return f"{ev.id}  {when}  {kind:<13}  {ev.fields.get(subject_key) or '-'}  {rest}".rstrip()


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
