"""Redis clients for the long-running producer side (bulk orchestrator, ``pagestream bulk-worker``).

A restart or failover of Redis takes seconds to a minute; those processes ride it out
instead of dying mid-bulk. Every command is retried on connection errors and timeouts
with redis-py's own ``Retry`` and exponential backoff (reconnecting each time) for up to
``PAGESTREAM_REDIS_OUTAGE_S`` seconds, after which the error is raised as before. A
command that may have run before its connection dropped is made safe to repeat by its
caller (the orchestrator's checkpoint commit checks whether it already landed).
"""
from __future__ import annotations

import math

import redis
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

#: the longest pause between two attempts while Redis is away
BACKOFF_CAP_S = 2.0


class OutageSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGESTREAM_", extra="ignore")

    #: how long a command keeps retrying while Redis is unreachable
    redis_outage_s: float = Field(300.0, ge=0)


def outage_retry(outage_s: float | None = None) -> Retry:
    """Retry on ``ConnectionError``/``TimeoutError`` with backoff 50 ms .. 2 s for about ``outage_s`` seconds."""
    outage_s = OutageSettings().redis_outage_s if outage_s is None else outage_s
    ramp = 6  # 0.05 + 0.1 + ... + 1.6 s before the cap: ~3 s
    return Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=0.05), ramp + math.ceil(outage_s / BACKOFF_CAP_S))


class Backoff:
    """The pause before the next retry after consecutive failures: ``base``, doubling each time, at most
    ``cap`` (redis-py's ``ExponentialBackoff``); ``reset`` after a success. Every retry loop of the
    worker (the run loop, pulls, the publisher, bulk part writes) counts its failures with one."""

    def __init__(self, base: float, cap: float) -> None:
        self._policy = ExponentialBackoff(cap=cap, base=base)
        self.failures = 0

    def next(self) -> float:
        """Count one more failure; the seconds to wait before trying again."""
        delay = self._policy.compute(self.failures)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self.failures = 0


def same_server(conn: redis.Redis, *, decode_responses: bool, retry: Retry | None = None) -> redis.Redis:
    """A new client on ``conn``'s server and db, decoding or not (RQ wants bytes, our helpers str),
    with ``retry`` instead of ``conn``'s own policy when given."""
    if is_cluster(conn):
        from redis.cluster import RedisCluster

        node = conn.get_default_node()
        kwargs = {"decode_responses": decode_responses, **({"retry": retry} if retry is not None else {})}
        return RedisCluster(host=node.host, port=node.port, **kwargs)
    pool = conn.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs["decode_responses"] = decode_responses
    if retry is not None:
        kwargs["retry"] = retry
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))


def outage_proof(url: str, *, decode_responses: bool, outage_s: float | None = None) -> redis.Redis:
    """A client for ``url`` that rides out a Redis outage of ``outage_s`` seconds (see the module doc)."""
    return connect(url, decode_responses=decode_responses, retry=outage_retry(outage_s), socket_connect_timeout=5)


# ---- Redis Cluster: the same URL, any node -------------------------------------------------------
def is_cluster(client: object) -> bool:
    """Whether ``client`` is a Redis Cluster client (sync or asyncio)."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

    return isinstance(client, (RedisCluster, AsyncRedisCluster))


def url_is_cluster(url: str, timeout_s: float = 5.0) -> bool:
    """Does the server at ``url`` run in cluster mode (``INFO cluster`` says ``cluster_enabled:1``)?

    A server that cannot be reached counts as a single node: clients are lazy, so the
    error surfaces at the first command, as it did before cluster support (a CLI says
    "cannot reach Redis" in one line, a worker backs off).
    """
    probe = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return int(probe.info("cluster").get("cluster_enabled", 0)) == 1
    except (redis.ConnectionError, redis.TimeoutError):
        return False
    finally:
        probe.close()


def _cluster_kwargs(kwargs: dict) -> dict:
    # RedisCluster has no db (always 0) and manages its own connection pools per node.
    return {k: v for k, v in kwargs.items() if k not in ("db", "connection_pool", "health_check_interval")}


# ---- stale pooled connections: one retry on a fresh connection -------------------------------------
#: seconds a pooled connection may sit idle before its next command checks it with a PING first
HEALTH_CHECK_INTERVAL_S = 30


def _stale_retry_kwargs(retry_class) -> dict:
    """A restart of Redis leaves every pooled connection dead; the first command on one fails with
    ``ConnectionError`` (or ``TimeoutError``). redis-py then disconnects it and runs the command once more
    on a fresh connection (``Retry(ExponentialBackoff(...), 1)``): a Redis that is back answers it, one
    still away raises as before. A caller's own ``retry`` (``outage_proof``) takes precedence."""
    return {
        "retry": retry_class(ExponentialBackoff(cap=BACKOFF_CAP_S, base=0.05), 1),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
    }


def _with_stale_retry(kwargs: dict, retry_class) -> dict:
    defaults = _stale_retry_kwargs(retry_class)
    if "retry" in kwargs:  # the caller's policy; still on these errors
        defaults.pop("retry")
    return {**defaults, **kwargs}


def connect(url: str, **kwargs) -> redis.Redis:
    """A client for ``url``: ``RedisCluster`` when that server is a cluster node, else ``Redis``.

    Every process (producer, worker, CLI, bulk) opens Redis through here, so one
    ``--redis-url`` naming any node of a cluster works everywhere, and every command
    survives a stale pooled connection (``_stale_retry_kwargs``).
    """
    if url_is_cluster(url):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, **_cluster_kwargs(kwargs))
    return redis.Redis.from_url(url, **_with_stale_retry(kwargs, Retry))


def connect_async(url: str, *, blocking_pool_timeout: float | None = None, **kwargs):
    """``connect`` for redis.asyncio (the probe is one blocking round trip, at construction).

    With ``blocking_pool_timeout`` a single node's pool is a ``BlockingConnectionPool``: a command waits
    up to that many seconds for a free connection of ``max_connections`` instead of failing at once.
    """
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry as AsyncRetry

    if url_is_cluster(url):
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, **_cluster_kwargs(kwargs))
    kwargs = _with_stale_retry(kwargs, AsyncRetry)
    if blocking_pool_timeout is None:
        return aioredis.Redis.from_url(url, **kwargs)
    pool = aioredis.BlockingConnectionPool.from_url(url, timeout=blocking_pool_timeout, **kwargs)
    return aioredis.Redis(connection_pool=pool)


def queue_script(pipe, command: str, script: str, keys: list, args: list):
    """Queue ``EVAL script`` / ``EVALSHA sha`` on a pipeline, a cluster one routed by its first key.

    redis-py's cluster pipeline asks the server for the keys of every EVAL it queues (COMMAND
    GETKEYS: one extra round trip per script, which halved the worker's throughput); a script's
    keys share one slot, so its node is the first key's. A MOVED reply (resharding) is retried
    by redis-py as for any command.
    """
    from redis.cluster import ClusterPipeline

    kwargs = {"target_nodes": pipe.get_node_from_key(keys[0])} if isinstance(pipe, ClusterPipeline) and keys else {}
    return pipe.execute_command(command, script, len(keys), *keys, *args, **kwargs)
