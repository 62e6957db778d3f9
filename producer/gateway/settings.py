"""What a gateway is configured with: pydantic-settings from ``PAGESTREAM_GATEWAY_*`` and ``REDIS_URL``."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pagestream.producer.bulk.rq_queue import BULK_QUEUE


class GatewaySettings(BaseSettings):
    """Env: ``PAGESTREAM_GATEWAY_`` + field name upper-cased (``PAGESTREAM_GATEWAY_API_KEYS=k1,k2``), and ``REDIS_URL``."""

    model_config = SettingsConfigDict(env_prefix="PAGESTREAM_GATEWAY_", extra="ignore", populate_by_name=True,
                                      hide_input_in_errors=True)  # errors never echo a key

    redis_url: str = Field("redis://localhost:6379/0", validation_alias="REDIS_URL")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # empty (and no keys file): no key needed. Each entry is ``key``, ``key:tenant`` or ``key:tenant:admin``
    # (producer.protocol.tenants); a tenant sees only its own files, batches and jobs.
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)
    api_keys_file: Path | None = None  # more key specs, one a line (``#`` comments)
    max_queue_depth: int | None = Field(None, ge=1)  # jobs of one model waiting for a worker; past it: 429
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    request_timeout_s: float = Field(600.0, gt=0)  # a job not finished by then is cancelled, 504
    model_refresh_s: float = Field(1.0, gt=0)  # how long the served-model list is trusted
    # Redis commands in flight at once; past this many, requests wait for a connection. Open streams and
    # waiting requests share one blocking XREAD on a single node (client/mux); on a cluster each holds one.
    redis_max_connections: int = Field(4096, ge=8)
    # /v1/files and /v1/batches: uploads and batch outputs (a directory, or s3://bucket/prefix with S3_ENDPOINT_URL etc.)
    files_uri: str = Field(default_factory=lambda: str(Path.home() / ".cache" / "pagestream" / "files"))
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024)  # OpenAI's limit for a batch input file
    bulk_queue: str = BULK_QUEUE  # the RQ queue ``pagestream bulk-worker`` runs batches from

    def key_specs(self) -> list[str]:
        """Every key spec: ``api_keys`` then the lines of ``api_keys_file``."""
        from pagestream.producer.protocol.tenants import read_keys_file

        return [*self.api_keys, *(read_keys_file(self.api_keys_file) if self.api_keys_file else [])]

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        return [k.strip() for k in v.split(",") if k.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _keys_parse(self) -> "GatewaySettings":
        from pagestream.producer.protocol.tenants import key_table

        key_table(self.key_specs())  # a bad spec or an unreadable keys file fails here, at start
        return self
