"""The RQ side of bulks, locked down: the bulk queue runs pagestream's orchestrator and nothing else.

Anyone who can write to Redis can enqueue an RQ job, and RQ imports and calls whatever
function a job names (``subprocess.check_call`` included), and unpickles a job's
``meta`` unless told otherwise. So the bulk queue uses the JSON serializer everywhere
(enqueue, fetch, worker) and ``BulkJob``, whose ``func`` resolves only the names in
``ALLOWED_FUNCS``, on no instance, with one string argument (the bulk id: a planted
``redis_url`` keyword would point the orchestrator at another server), with no callbacks. A job naming anything else fails
in the worker with ``UnsafeJobError`` before any import happens.

Plain ``rq`` works too when told the same: ``rq worker pagestream-bulk
-S rq.serializers.JSONSerializer --job-class producer.bulk.rq_queue.BulkJob``.
"""
from __future__ import annotations

import redis
from rq import Queue, SimpleWorker
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from pagestream.producer.protocol.redis_conn import is_cluster, same_server
from pagestream.producer.protocol.settings import rq_redis_url

#: the RQ queue bulk orchestration jobs go to
BULK_QUEUE = "pagestream-bulk"
#: the importable function an RQ worker runs; enqueue it with the bulk id as its only argument
RUN_BULK_FUNC = "pagestream.producer.bulk.orchestrator.run_bulk"
#: every function a bulk-queue job may name
ALLOWED_FUNCS = frozenset({RUN_BULK_FUNC})


class BulkWorker(SimpleWorker):
    """The bulk queue's RQ worker: a ``SimpleWorker`` (the orchestrator is I/O bound and holds no GPU, and one
    process means kill -9 takes the orchestrator with it) whose exit does not wait out its pub/sub listener.

    RQ 3.0 listens for worker commands on a redis-py thread that waits up to 60 s per ``get_message``, and
    stops it by sending UNSUBSCRIBE, then clearing the thread's run flag and joining it. If the thread reads
    the UNSUBSCRIBE reply before the flag is cleared, it goes back to wait 60 s for a subscription that never
    comes, and the join (no timeout in redis-py 8.2's ``stop``) holds the worker's exit, a ``--burst`` run
    included, for that minute. Here the flag is cleared first, so the reply ends the thread, and the join is
    bounded."""

    def unsubscribe(self):
        thread = self.pubsub_thread
        if thread is None:
            return
        self.log.info("Worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        # the run flag cleared before the UNSUBSCRIBE reply can wake the thread, so it then leaves its loop
        try:
            thread.stop(timeout=0)
        except TypeError:  # redis-py before 8: stop() only clears the flag
            thread.stop()
        try:
            self.pubsub.unsubscribe()
        finally:
            thread.join(timeout=2)
            self.pubsub.close()


class UnsafeJobError(RuntimeError):
    """An RQ job on the bulk queue named something other than pagestream's orchestrator."""


class BulkJob(Job):
    """RQ job class for the bulk queue: resolves only ``ALLOWED_FUNCS`` and never a callback.

    A job hash RQ cannot parse (a planted ``timeout: " "``, say) counts as absent: RQ skips
    and forgets it instead of letting the error stop the worker at every start.
    """

    def restore(self, raw_data):
        try:
            return super().restore(raw_data)
        except NoSuchJobError:
            raise
        except Exception as exc:  # whatever RQ's parsing of a stranger's hash raises
            raise NoSuchJobError(f"job {self.id}: unreadable job hash ({type(exc).__name__}); treated as absent") from exc

    @property
    def func(self):
        name = self.func_name
        if self.instance is not None or name not in ALLOWED_FUNCS:
            raise UnsafeJobError(f"refusing to run {name!r}: the bulk queue runs only {sorted(ALLOWED_FUNCS)}")
        if self.kwargs or len(self.args) != 1 or not isinstance(self.args[0], str):
            raise UnsafeJobError(f"refusing to run {name!r} with arguments other than one bulk id")
        return super().func

    # Callbacks are importable names too; pagestream never sets any, so none is ever resolved.
    @property
    def success_callback(self):
        return None

    @property
    def failure_callback(self):
        return None

    @property
    def stopped_callback(self):
        return None


class RQNeedsSingleNode(ValueError):
    """The main Redis is a cluster and no single-node Redis was named for RQ."""


def rq_connection(conn: redis.Redis) -> redis.Redis:
    """A client for RQ (it wants bytes back, our helpers decode): ``PAGESTREAM_RQ_REDIS_URL`` when
    set, else the same server as ``conn``.

    RQ cannot use Redis Cluster: its enqueue is a transaction over the job hash, the queue
    list and the queue set, fixed names in different slots. With a cluster, the bulk queue
    lives on a single-node Redis of its own; everything else of a bulk (status hash, lease,
    jobs, lanes) stays on the cluster.
    """
    url = rq_redis_url()
    if url is not None:
        return redis.Redis.from_url(url)
    if is_cluster(conn):
        raise RQNeedsSingleNode("the bulk queue (RQ) does not run on Redis Cluster: set PAGESTREAM_RQ_REDIS_URL "
                                "(or --rq-redis-url) to a single-node Redis for it")
    return same_server(conn, decode_responses=False)


def bulk_queue(connection: redis.Redis, name: str = BULK_QUEUE) -> Queue:
    """The RQ queue for orchestration jobs: JSON serializer (never pickle), ``BulkJob`` jobs."""
    return Queue(name, connection=connection, serializer=JSONSerializer, job_class=BulkJob)


def fetch_job_status(conn: redis.Redis, rq_job_id: str):
    """The RQ status of a bulk's orchestration job, or ``None`` when it is gone or unreadable.

    Read with the JSON serializer: a job hash planted with a pickled ``meta`` fails to
    decode here instead of running code.
    """
    try:
        return BulkJob.fetch(rq_job_id, connection=rq_connection(conn), serializer=JSONSerializer).get_status()
    except NoSuchJobError:
        return None
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError):
        return None  # not a job pagestream wrote
