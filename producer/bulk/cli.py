"""``pagestream bulk ...`` and ``pagestream bulk-worker``: no torch, no engine imports here.

``worker/cli.py`` mounts these:

    from pagestream.producer.bulk.cli import bulk_app, bulk_worker
    app.add_typer(bulk_app, name="bulk")
    app.command("bulk-worker")(bulk_worker)
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from enum import Enum
from typing import Optional

import redis
import typer

from pagestream.producer.bulk.rq_queue import BulkWorker
from pagestream.producer.bulk.api import BULK_QUEUE, BulkStatus, cancel_bulk, dumps_status, get_bulk, list_bulks, rescue_stalled, submit_bulk
from pagestream.producer.protocol.tool_parsers import TOOL_PARSERS
from pagestream.producer.protocol.redaction import install_log_redaction
from pagestream.producer.bulk.storage import is_s3, local_path
from pagestream.producer.protocol.schema import Lane
from pagestream.producer.protocol.settings import RQ_REDIS_URL_ENV, S3_ADDRESSING_ENV, S3_ENDPOINT_ENV, S3_REGION_ENV
from pagestream.producer.protocol.redis_conn import connect, is_cluster, outage_proof
from pagestream.producer.protocol.cli import fail, redis_url_option, resolve_url

log = logging.getLogger(__name__)

bulk_app = typer.Typer(help="Bulk dataset generation: OpenAI-batch JSONL in, sharded JSONL out.", no_args_is_help=True)

_REDIS_URL = redis_url_option()
_RQ_REDIS_URL = typer.Option(None, "--rq-redis-url", envvar=list(RQ_REDIS_URL_ENV), show_envvar=True,
                             show_default="--redis-url", help="single-node Redis for the bulk queue (RQ); "
                             "needed when --redis-url is a Redis Cluster, which RQ cannot use")
_S3_ENDPOINT = typer.Option(None, "--s3-endpoint-url", envvar=list(S3_ENDPOINT_ENV), show_envvar=True,
                            show_default="AWS", help="S3-compatible endpoint (MinIO, moto)")


class AddressingStyleChoice(str, Enum):
    auto = "auto"
    virtual = "virtual"
    path = "path"


def _conn(url: str | None) -> redis.Redis:
    return connect(resolve_url(url), decode_responses=True)


@bulk_app.command("submit")
def submit(
    input: str = typer.Argument(..., help="input JSONL: local path, file:// or s3://bucket/key"),
    out: str = typer.Option(..., "--out", help="output: local dir, file:// or s3://bucket/prefix"),
    redis_url: Optional[str] = _REDIS_URL,
    rq_redis_url: Optional[str] = _RQ_REDIS_URL,
    shard_lines: int = typer.Option(10_000, "--shard-lines", min=1, help="lines per output shard"),
    model: str = typer.Option(None, "--model", show_default="none", help="model name recorded in bodies when a line has none"),
    lane: Lane = typer.Option(Lane.LOW, "--lane", help="lane the jobs go to"),
    max_outstanding: int = typer.Option(2_048, "--max-outstanding", min=1, help="queued-but-unfinished job bound"),
    completion_window_s: float = typer.Option(None, "--completion-window-s", show_default="never",
                                              help="expire after this many seconds (what is done is finalized)"),
    s3_endpoint_url: Optional[str] = _S3_ENDPOINT,
    s3_region: Optional[str] = typer.Option(None, "--s3-region", envvar=list(S3_REGION_ENV), show_envvar=True,
                                            show_default="boto3's", help="S3 region"),
    s3_addressing_style: Optional[AddressingStyleChoice] = typer.Option(
        None, "--s3-addressing-style", envvar=list(S3_ADDRESSING_ENV), show_envvar=True,
        show_default="boto3's", help="bucket addressing (path for most MinIO set-ups)"),
    tool_call_parser: Optional[str] = typer.Option(
        None, "--tool-call-parser", show_default="none",
        help=f"read the calls of tool_choice=auto lines with this parser ({', '.join(sorted(TOOL_PARSERS))}), as vLLM "
             "run-batch's --enable-auto-tool-choice --tool-call-parser; without it an auto line is an error line"),
    wait: bool = typer.Option(False, "--wait", help="show progress and return when the bulk is final"),
) -> None:
    """Submit a bulk; prints its id."""
    if not is_s3(input) and not local_path(input).is_file():
        fail(f"input file {local_path(input).resolve()} does not exist")
    if rq_redis_url:
        os.environ["PAGESTREAM_RQ_REDIS_URL"] = rq_redis_url  # where producer.bulk.rq_queue enqueues
    conn = _conn(redis_url)
    try:
        bulk_id = submit_bulk(input, out, connection=conn, model=model, lane=lane.value, shard_lines=shard_lines,
                              max_outstanding=max_outstanding, completion_window_s=completion_window_s,
                              s3_endpoint_url=s3_endpoint_url, s3_region=s3_region,
                              s3_addressing_style=s3_addressing_style.value if s3_addressing_style else None,
                              tool_call_parser=tool_call_parser)
    except ValueError as exc:  # RQNeedsSingleNode too
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(bulk_id)
    if wait:
        raise typer.Exit(_wait(conn, bulk_id))


def _wait(conn: redis.Redis, bulk_id: str, poll_s: float = 0.5) -> int:
    from tqdm import tqdm

    bar = tqdm(desc=bulk_id, unit="req", dynamic_ncols=True)
    try:
        while True:
            st = get_bulk(conn, bulk_id)
            counts = st["request_counts"]
            if st["input_done"] and bar.total != counts["total"]:
                bar.total = counts["total"]
            bar.n = counts["completed"] + counts["failed"]
            # a sink error is why a bulk stops moving: show it while it lasts
            extra = {"sink_error": st["sink_error"][:200]} if st.get("sink_error") else {}
            bar.set_postfix(status=st["status"], failed=counts["failed"], **extra, refresh=False)
            bar.refresh()
            if BulkStatus(st["status"]).is_final:
                break
            time.sleep(poll_s)
    finally:
        bar.close()
    typer.echo(f"{st['status']}: {counts['completed']} completed, {counts['failed']} failed"
               + (f"; manifest {st['manifest']}" if st.get("manifest") else "")
               + (f"; error: {st['error']}" if st.get("error") else ""))
    return 0 if st["status"] == BulkStatus.COMPLETED.value else 1


@bulk_app.command("status")
def status(
    bulk_id: str = typer.Argument(..., help="the bulk (as `bulk submit` printed it)"),
    redis_url: Optional[str] = _REDIS_URL,
    as_json: bool = typer.Option(False, "--json", help="print the full status as JSON"),
) -> None:
    """Show a bulk's status and request counts."""
    from pagestream.producer.bulk.batches import batch_object

    try:
        conn = _conn(redis_url)
        # --json: OpenAI's Batch object (openai.types.Batch validates it) plus pagestream's fields
        st = batch_object(conn, bulk_id, internal=True) if as_json else get_bulk(conn, bulk_id)
    except KeyError:
        fail(f"no bulk {bulk_id}")
    if as_json:
        typer.echo(dumps_status(st))
        return
    c = st["request_counts"]
    typer.echo(f"{bulk_id}  {st['status']}  total={c['total']} completed={c['completed']} failed={c['failed']}"
               f"  lines_read={st['lines_read']}{'' if st['input_done'] else '+'}")
    for k in ("manifest", "error", "sink_error"):
        if st.get(k):
            typer.echo(f"  {k}: {st[k]}")


@bulk_app.command("list")
def list_(
    redis_url: Optional[str] = _REDIS_URL,
    limit: int = typer.Option(20, "--limit", min=1, help="how many, newest first"),
    as_json: bool = typer.Option(False, "--json", help="one status JSON object per line"),
) -> None:
    """The newest bulks: id, status, request counts, created time."""
    conn = _conn(redis_url)
    bulk_ids = list_bulks(conn, limit)
    for bulk_id in bulk_ids:
        try:
            st = get_bulk(conn, bulk_id)
        except KeyError:
            continue  # expired between the index and its hash
        if as_json:
            typer.echo(json.dumps(st, sort_keys=True))
            continue
        c = st["request_counts"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(st["created_at"] or 0))
        typer.echo(f"{bulk_id}  {st['status']:<11} total={c['total']} completed={c['completed']} "
                   f"failed={c['failed']}  created {created} UTC  {st['output']}")
    if not bulk_ids and not as_json:
        typer.echo("no bulks", err=True)


@bulk_app.command("cancel")
def cancel(bulk_id: str = typer.Argument(..., help="the bulk to cancel"), redis_url: Optional[str] = _REDIS_URL) -> None:
    """Stop feeding a bulk; what is done is finalized and the bulk ends as cancelled."""
    try:
        typer.echo(cancel_bulk(_conn(redis_url), bulk_id))
    except KeyError:
        fail(f"no bulk {bulk_id}")


def bulk_worker(
    redis_url: Optional[str] = _REDIS_URL,
    rq_redis_url: Optional[str] = _RQ_REDIS_URL,
    queue: str = typer.Option(BULK_QUEUE, "--queue", help="RQ queue of orchestration jobs"),
    name: str = typer.Option(None, "--name", show_default="RQ's", help="RQ worker name"),
    burst: bool = typer.Option(False, "--burst", help="exit when the queue is empty"),
    concurrency: int = typer.Option(1, "--concurrency", min=1, envvar="PAGESTREAM_BULK_CONCURRENCY",
                                    help="bulks run at once: above 1, RQ workers in a pool (rq's WorkerPool, one process "
                                         "each), so one huge or stuck bulk never holds back another's start"),
    rescue_interval_s: float = typer.Option(5.0, "--rescue-interval-s", help="how often to look for stalled bulks"),
    s3_endpoint_url: Optional[str] = _S3_ENDPOINT,
) -> None:
    """Run the RQ worker for bulk orchestration jobs (plain ``rq worker`` works too when given the same serializer and job class: see ``producer/bulk/rq_queue.py``).

    Besides running jobs it re-enqueues bulks whose orchestrator died (lease expired).
    Once started it rides out Redis outages (``PAGESTREAM_REDIS_OUTAGE_S``, see
    ``producer/protocol/redis_conn.py``); Redis unreachable at start is an error.
    """
    from pagestream.producer.bulk.api import bulk_queue

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    install_log_redaction()
    if s3_endpoint_url:
        os.environ["S3_ENDPOINT_URL"] = s3_endpoint_url
    redis_url = resolve_url(redis_url)
    connect(redis_url, socket_connect_timeout=5).ping()  # fail fast: main() says why in one line
    decoded = outage_proof(redis_url, decode_responses=True)
    if rq_redis_url is None and is_cluster(decoded):
        fail("the bulk queue (RQ) does not run on Redis Cluster: give --rq-redis-url (PAGESTREAM_RQ_REDIS_URL), "
             "a single-node Redis for it")
    if rq_redis_url is not None:
        # the orchestrators this worker runs read both from the environment (an RQ job carries only a bulk id)
        os.environ["PAGESTREAM_RQ_REDIS_URL"] = rq_redis_url
        os.environ["PAGESTREAM_REDIS_URL"] = redis_url
    conn = outage_proof(rq_redis_url or redis_url, decode_responses=False)  # RQ wants bytes responses
    rescue_stalled(decoded, queue)
    stop = threading.Event()

    def rescue_loop() -> None:
        while not stop.wait(rescue_interval_s):
            try:
                for bulk_id in rescue_stalled(decoded, queue):
                    log.warning("re-enqueued stalled bulk %s", bulk_id)
            except redis.RedisError as exc:
                log.warning("stalled-bulk scan failed (%s); next one in %.0fs", exc, rescue_interval_s)

    threading.Thread(target=rescue_loop, name="bulk-rescue", daemon=True).start()
    q = bulk_queue(conn, queue)
    backoff_s = 1.0
    try:
        if concurrency > 1:
            # the pool forks its workers and starts a fresh one for any that dies (an RQ loop quitting
            # on an error, a kill -9): the restart the loop below does by hand for a single worker
            from rq.worker_pool import WorkerPool

            pool = WorkerPool([q], connection=conn, num_workers=concurrency, worker_class=_PoolBulkWorker,
                              serializer=q.serializer, job_class=q.job_class)
            pool.start(burst=burst, logging_level="INFO")
            return
        while True:
            worker = _BulkWorker([q], connection=conn, name=name, serializer=q.serializer, job_class=q.job_class)
            try:
                worker.work(burst=burst, logging_level="INFO")
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("RQ worker lost Redis (%s)", exc)
            if burst or worker.stop_requested:
                return
            # RQ's loop quits on an error it does not handle (Redis away longer than the retry
            # budget): start a fresh worker after a pause instead of leaving bulks unattended.
            log.warning("RQ worker stopped on an error; starting a new one in %.0fs", backoff_s)
            time.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, 30.0)
    finally:
        stop.set()


class _BulkWorker(BulkWorker):
    """``BulkWorker`` that remembers whether it stopped on request (a signal) or on an error."""

    stop_requested = False

    def request_stop(self, signum, frame):
        self.stop_requested = True
        return super().request_stop(signum, frame)


class _PoolBulkWorker(_BulkWorker):
    """A ``WorkerPool`` child: it dies with the pool (Linux's parent-death signal), so kill -9 of the
    bulk-worker still takes its orchestrators with it and their bulks are rescued, never orphaned."""

    def __init__(self, *args, **kwargs):
        _die_with_parent()
        super().__init__(*args, **kwargs)

    def work(self, *args, **kwargs):
        # rq's pool asks each worker for a scheduler process, which is not a pool child: it would outlive a
        # kill -9 of the pool, holding RQ's scheduler lock. Bulk jobs are never scheduled (their Retry has no
        # interval), so the pool's workers run none.
        kwargs["with_scheduler"] = False
        return super().work(*args, **kwargs)


def _die_with_parent() -> None:
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the pool died before the signal was armed
        os._exit(1)
