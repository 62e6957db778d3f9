"""How many streams each lane has on this Redis, and which one a job goes to.

A single node keeps one stream per lane (``keys.jobs_stream``). On Redis Cluster every
lane is split into ``lane_shards`` streams, each under its own hash tag
(``keys.lane_stream_shards``), so the queue's traffic spreads over the masters. A producer
puts a job on one shard (chosen from its job id); a worker reads them all. The shard count
is written once per Redis (``keys.lane_layout()``, HSETNX) and every process reads it from
there, so producers and workers agree even when their settings differ: a worker reading
fewer shards than producers write to would strand jobs.
"""
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagestream.producer.protocol import keys

log = logging.getLogger(__name__)

#: streams per lane on a Redis Cluster when nobody chose another count first
DEFAULT_CLUSTER_LANE_SHARDS = 8


class LaneSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGESTREAM_", extra="ignore")

    #: streams per lane on a cluster, used by the first process that meets a cluster without a layout
    lane_shards: int = Field(DEFAULT_CLUSTER_LANE_SHARDS, ge=1, le=1024)


@dataclass(frozen=True, slots=True)
class LaneLayout:
    """The lane streams of one Redis: ``num_shards`` per lane (1 on a single node)."""

    num_shards: int = 1

    @property
    def sharded(self) -> bool:
        return self.num_shards > 1

    def shard_of(self, job_id: str) -> int:
        """The shard a job is submitted to: a stable hash of its id, so a retried submit goes to the same one."""
        return zlib.crc32(job_id.encode()) % self.num_shards if self.sharded else 0

    def lane_keys(self, lane: str) -> list[str]:
        """``lane`` for shard 0, then ``lane/1`` ... (``keys.lane_key``)."""
        return [keys.lane_key(lane, i) for i in range(self.num_shards)]

    def stream(self, lane_key: str, model: str | None = None) -> str:
        """The stream behind a lane key (``normal`` or ``normal/3``)."""
        lane, shard = keys.split_lane_key(lane_key)
        if shard == 0:
            return keys.jobs_stream(lane, model)
        return keys.lane_stream_shards(lane, model, self.num_shards)[shard]

    def streams(self, lane: str, model: str | None = None) -> list[str]:
        return keys.lane_stream_shards(lane, model, self.num_shards)


SINGLE = LaneLayout(1)


def layout_args() -> tuple[str, str, int]:
    """(key, field, default count) for the HSETNX that fixes a cluster's layout once."""
    return keys.lane_layout(), "lane_shards", LaneSettings().lane_shards


def resolve_layout(client) -> LaneLayout:
    """The layout of ``client``'s Redis: one stream per lane on a single node; on a cluster the
    stored shard count (storing ``PAGESTREAM_LANE_SHARDS`` first if none is stored yet)."""
    from pagestream.producer.protocol.redis_conn import is_cluster

    if not is_cluster(client):
        return SINGLE
    key, field, want = layout_args()
    client.hsetnx(key, field, want)
    stored = int(client.hget(key, field))
    if stored != want:
        log.info("this cluster's lanes have %d shards (set when it was first used); PAGESTREAM_LANE_SHARDS=%d is ignored",
                 stored, want)
    return LaneLayout(stored)
