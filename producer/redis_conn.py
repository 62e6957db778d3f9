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


def same_server(conn: redis.Redis, *, decode_responses: bool, retry: Retry | None = None) -> redis.Redis:
    """A new client on ``conn``'s server and db, decoding or not (RQ wants bytes, our helpers str),
    with ``retry`` instead of ``conn``'s own policy when given."""
    pool = conn.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs["decode_responses"] = decode_responses
    if retry is not None:
        kwargs["retry"] = retry
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))


def outage_proof(url: str, *, decode_responses: bool, outage_s: float | None = None) -> redis.Redis:
    """A client for ``url`` that rides out a Redis outage of ``outage_s`` seconds (see the module doc)."""
    return redis.Redis.from_url(url, decode_responses=decode_responses, retry=outage_retry(outage_s),
                                socket_connect_timeout=5)
