"""Settings every pagestream process shares, from the environment (pydantic-settings).

One prefix for everything: ``PAGESTREAM_<FIELD>``. The names other tools already use are
honoured as aliases: ``REDIS_URL`` for ``PAGESTREAM_REDIS_URL``, and the S3/AWS ones
(``S3_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, ``AWS_REGION``,
``AWS_DEFAULT_REGION``); the ``PAGESTREAM_`` name wins when both are set. Credentials are
never settings of ours: boto3 finds them itself (env, profile, instance role).
"""
from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "PAGESTREAM_"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"

#: env names of each aliased setting, first one wins (what ``--help`` shows)
REDIS_URL_ENV = ("PAGESTREAM_REDIS_URL", "REDIS_URL")
S3_ENDPOINT_ENV = ("PAGESTREAM_S3_ENDPOINT_URL", "S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
S3_REGION_ENV = ("PAGESTREAM_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION")
S3_ADDRESSING_ENV = ("PAGESTREAM_S3_ADDRESSING_STYLE",)
#: RQ (the bulk queue) needs a single-node Redis; on Redis Cluster it lives on this one
RQ_REDIS_URL_ENV = ("PAGESTREAM_RQ_REDIS_URL",)


class ClientSettings(BaseSettings):
    """Where Redis is, for every command and client."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", populate_by_name=True)

    redis_url: str = Field(DEFAULT_REDIS_URL, validation_alias=AliasChoices(*REDIS_URL_ENV))
    # RQ does not run on Redis Cluster (its keys span slots in one transaction): with a cluster,
    # the bulk queue lives on this single-node Redis. None: RQ shares the Redis of redis_url.
    rq_redis_url: str | None = Field(None, validation_alias=AliasChoices(*RQ_REDIS_URL_ENV))


def rq_redis_url(explicit: str | None = None) -> str | None:
    """``explicit`` (a ``--rq-redis-url``), else ``PAGESTREAM_RQ_REDIS_URL``, else None (RQ shares the main Redis)."""
    return explicit or ClientSettings().rq_redis_url


def redis_url(explicit: str | None = None) -> str:
    """``explicit`` (a ``--redis-url``), else the environment, else the default."""
    return explicit or ClientSettings().redis_url
