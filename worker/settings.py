"""Worker configuration: pydantic-settings from the environment, overridden by CLI flags."""
from __future__ import annotations

import os
import socket

from typing import Annotated

from pydantic import AliasChoices, Field, create_model, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pagestream.producer.protocol import keys
from pagestream.producer.protocol.limits import job_limits
from pagestream.producer.protocol.settings import DEFAULT_REDIS_URL, REDIS_URL_ENV, S3_ENDPOINT_ENV
from pagestream.worker.engine_options import settings_fields


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class _QueueSettings(BaseSettings):
    """Everything a worker needs (``WorkerSettings`` below adds the engine's knobs). Env vars are the field names upper-cased with a
    ``PAGESTREAM_`` prefix (``PAGESTREAM_LEASE_MS``), except the shared ones named below."""

    model_config = SettingsConfigDict(env_prefix="PAGESTREAM_", extra="ignore", populate_by_name=True)

    redis_url: str = Field(DEFAULT_REDIS_URL, validation_alias=AliasChoices(*REDIS_URL_ENV))
    model: str | None = None  # HF dir, or "fake" for the instant fake engine (tests, benchmarks)
    # Routing by model: with a name, the worker announces it and reads only that model's lanes
    # (worker.routing); without one it reads the shared lanes (jobs that name no model).
    served_model_name: str | None = Field(None, pattern=r"^[^\s{}]{1,256}$")
    group: str = keys.DEFAULT_GROUP
    consumer: str = Field(default_factory=default_consumer_name)
    lanes: Annotated[list[str], NoDecode] = Field(default_factory=lambda: list(keys.LANES))  # env: high,normal

    # the engine's knobs (max_num_seqs, dtype, block_size, ...) are added below from EngineConfig
    # (worker/engine_options.py); None takes the engine's default. max_num_seqs None: 512 on a GPU,
    # 8 on the CPU, where a step over many sequences is slow and the queue is better shared among workers.
    # run the engine core in a process of its own (engine.engine_process), so the worker's Redis
    # I/O and threads never hold the GIL its step needs; None: on for CUDA, off on the CPU
    engine_process: bool | None = None

    # queue behaviour
    prefetch: int = Field(2, ge=0)  # entries read beyond what the engine can admit now
    lease_ms: int = Field(30_000, ge=100)  # an entry idle this long in a dead consumer's PEL is reclaimed
    max_deliveries: int = Field(3, ge=1)
    drain_timeout_s: float = Field(30.0, ge=0)
    block_ms: int = Field(1000, ge=1)  # XREADGROUP BLOCK when the worker is idle
    # while jobs run, look for new entries at most this often: a read per lane per engine step
    # would cost more host time than the step itself on a fast GPU
    busy_pull_interval_ms: float = Field(10.0, ge=0)
    publish_interval_ms: float = Field(20.0, ge=0)  # coalesce each job's deltas this long
    trim_interval_s: float = Field(10.0, gt=0)
    # a consumer holding no entries and idle this long is removed from the group (stats stay readable)
    stale_consumer_ms: int = Field(600_000, ge=1000)
    reclaim_interval_s: float | None = None  # default: lease_ms / 4
    dead_letter_maxlen: int = 100_000

    # hostile input: a raw XADD bypasses the producer's limits, so the worker has its own
    # a lane entry over this fails unparsed; by default the longest entry a job within the
    # producer's limits (PAGESTREAM_MAX_*) can need, so the two sides agree
    max_entry_bytes: int = Field(default_factory=lambda: job_limits().max_entry_bytes, ge=1024)
    dead_letter_payload_bytes: int = Field(64 * 1024, ge=0)  # the DLQ keeps this much of each field

    # bulk sink (worker.bulk_sink)
    s3_endpoint_url: str | None = Field(None, validation_alias=AliasChoices(*S3_ENDPOINT_ENV))
    bulk_flush_lines: int = Field(256, ge=1)
    bulk_flush_interval_s: float = Field(5.0, gt=0)
    # Backpressure: while this many bulk results wait for a durable part (default 4 x
    # bulk_flush_lines), the worker pulls nothing new; it keeps stepping and retrying flushes.
    bulk_max_buffered_lines: int | None = Field(None, ge=1)

    @field_validator("lanes", mode="before")
    @classmethod
    def _split_lanes(cls, v: object) -> object:
        if isinstance(v, str):
            v = [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("lanes")
    @classmethod
    def _known_lanes(cls, v: list[str]) -> list[str]:
        bad = [lane for lane in v if lane not in keys.LANES]
        if bad or not v:
            raise ValueError(f"lanes must be a non-empty subset of {list(keys.LANES)}, got {v}")
        # read order is fixed: high before normal before low
        return [lane for lane in keys.LANES if lane in v]

    @property
    def bulk_buffer_limit(self) -> int:
        return self.bulk_max_buffered_lines or 4 * self.bulk_flush_lines

    @property
    def reclaim_every_s(self) -> float:
        return self.reclaim_interval_s if self.reclaim_interval_s is not None else self.lease_ms / 4000


#: the worker's settings: the queue's above plus every engine knob, each ``PAGESTREAM_<NAME>``
WorkerSettings = create_model("WorkerSettings", __base__=_QueueSettings, __module__=__name__, **settings_fields())
