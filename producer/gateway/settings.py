"""What a gateway is configured with: pydantic-settings from ``PAGESTREAM_GATEWAY_*`` and ``REDIS_URL``."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pagestream.producer.bulk.rq_queue import BULK_QUEUE
from pagestream.producer.protocol.tenant_limits import DEFAULT_TENANT, TENANT_NAME_OR_DEFAULT, TenantLimits


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
    # per-tenant limits (producer.protocol.tenant_limits): tenant name -> TenantLimits, "*" the default for
    # every tenant, a tenant's entry overriding the fields it sets; JSON in the environment, e.g.
    # PAGESTREAM_GATEWAY_TENANT_LIMITS='{"*": {"max_queued_jobs": 100}, "alice": {"max_concurrent_streams": 4}}'.
    # Every gateway of one Redis must be given the same. Past a limit: 429 rate_limit_exceeded + retry-after.
    tenant_limits: dict[str, TenantLimits] = Field(default_factory=dict)
    tenant_limits_file: Path | None = None  # the same mapping as a JSON file, its entries over tenant_limits'
    max_queue_depth: int | None = Field(None, ge=1)  # jobs of one model waiting for a worker; past it: 429
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # processes that judge a body over 256 kB or of over 1,024 arrays/objects (counted, parsed, list bounds)
    # before the gateway parses it; 0: judged in a thread
    body_check_processes: int = Field(2, ge=0)
    # completions one request may ask for: its prompts times n (each prompt is a job of n samples); past
    # it a 400 naming both numbers, before a single job is queued
    max_request_choices: int = Field(256, ge=1)
    request_timeout_s: float = Field(600.0, gt=0)  # a job not finished by then is cancelled, 504
    # a stream whose client left: its job is cancelled unless a client resumes it (GET /v1/streams) within
    # this many seconds; 0: at once
    stream_resume_grace_s: float = Field(0.0, ge=0)
    # /v1/responses: how long a stored response (retrieve, previous_response_id) lives in Redis
    response_ttl_s: int = Field(7 * 24 * 3600, ge=1)
    model_refresh_s: float = Field(1.0, gt=0)  # how long the served-model list is trusted
    # Redis commands in flight at once; past this many, requests wait for a connection. Open streams and
    # waiting requests share one blocking XREAD on a single node (client/mux); on a cluster each holds one.
    redis_max_connections: int = Field(4096, ge=8)
    # /v1/files and /v1/batches: uploads and batch outputs (a directory, or s3://bucket/prefix with S3_ENDPOINT_URL etc.)
    files_uri: str = Field(default_factory=lambda: str(Path.home() / ".cache" / "pagestream" / "files"))
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024)  # OpenAI's limit for a batch input file
    # the HTTP server's own bounds (uvicorn): a connection that has not sent its first request's headers
    # within header_timeout_s is closed (slowloris); idle keep-alive connections close after
    # keep_alive_timeout_s; past max_connections open connections and requests, new ones get a 503;
    # a request line plus headers past max_header_bytes is a 400
    header_timeout_s: float = Field(10.0, gt=0)
    keep_alive_timeout_s: float = Field(5.0, gt=0)
    max_connections: int = Field(4096, ge=1)
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    # a stop (SIGTERM, Ctrl-C) waits this long for open requests and streams, then for background work,
    # before it cuts them (a cut stream resumes on another gateway with Last-Event-ID)
    shutdown_timeout_s: float = Field(30.0, gt=0)
    bulk_queue: str = BULK_QUEUE  # the RQ queue ``pagestream bulk-worker`` runs batches from
    # /tokenize, /detokenize, /tokenizer_info: how long the gateway waits for a worker's tokenizer (past it: 503)
    tokenizer_timeout_s: float = Field(5.0, gt=0)
    # GET /tokenizer_info answers only when enabled (vLLM's --enable-tokenizer-info-endpoint): it shows the
    # tokenizer's configuration, chat template included
    enable_tokenizer_info_endpoint: bool = False
    # tool_choice "auto" (vLLM's --enable-auto-tool-choice --tool-call-parser NAME): the parser that reads calls
    # out of the model's text (producer.protocol.tool_parsers: hermes, llama3_json, mistral)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # a chat template sent with a request (``chat_template``; vLLM's --trust-request-chat-template): refused with
    # a 400 unless set. The worker renders it in transformers' sandboxed Jinja, but a template is code a client
    # runs on the worker (its time, its memory): trust it only from clients you trust
    trust_request_chat_template: bool = False
    # usage.prompt_tokens_details = {"cached_tokens": N} on chat and completions responses (whole, and a stream's
    # usage chunk) when N > 0: the prompt tokens served from a worker's prefix cache (vLLM's
    # --enable-prompt-tokens-details); absent otherwise
    enable_prompt_tokens_details: bool = False
    # a worker's Prometheus endpoint (``http://127.0.0.1:PORT/metrics``) whose series this gateway's /metrics carries
    # after its own, the families it already has left out: ``pagestream serve`` sets it to its worker's, so one
    # scrape of the one machine gets both. A worker that does not answer within worker_metrics_timeout_s is left out.
    worker_metrics_url: str | None = None
    worker_metrics_timeout_s: float = Field(0.5, gt=0)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, v: str | None) -> str | None:
        from pagestream.producer.protocol.tool_parsers import known_parser

        return known_parser(v)

    @model_validator(mode="after")
    def _auto_needs_parser(self) -> "GatewaySettings":
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser)")
        return self

    def key_specs(self) -> list[str]:
        """Every key spec: ``api_keys`` then the lines of ``api_keys_file``."""
        from pagestream.producer.protocol.tenants import read_keys_file

        return [*self.api_keys, *(read_keys_file(self.api_keys_file) if self.api_keys_file else [])]

    def limit_table(self):
        """The per-tenant limits: ``tenant_limits`` with ``tenant_limits_file``'s entries over them."""
        from pagestream.producer.protocol.tenant_limits import LimitTable

        return LimitTable({**self.tenant_limits, **self._limits_file()})

    def _limits_file(self) -> dict[str, TenantLimits]:
        if self.tenant_limits_file is None:
            return {}
        import json

        raw = json.loads(self.tenant_limits_file.read_text())
        if not isinstance(raw, dict):
            raise ValueError("tenant_limits_file must hold a JSON object: tenant name -> limits")
        return {name: TenantLimits.model_validate(v) for name, v in raw.items()}

    @field_validator("tenant_limits")
    @classmethod
    def _tenant_names(cls, v: dict[str, TenantLimits]) -> dict[str, TenantLimits]:
        return _check_tenant_names(v)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        return [k.strip() for k in v.split(",") if k.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _keys_parse(self) -> "GatewaySettings":
        from pagestream.producer.protocol.tenants import key_table

        key_table(self.key_specs())  # a bad spec or an unreadable keys file fails here, at start
        _check_tenant_names(self._limits_file())  # and so does a bad limits file
        return self


def _check_tenant_names(table: dict[str, TenantLimits]) -> dict[str, TenantLimits]:
    bad = [name for name in table if not TENANT_NAME_OR_DEFAULT.match(name)]
    if bad:
        raise ValueError(f"tenant_limits: {bad} are not tenant names (or '{DEFAULT_TENANT}', the default)")
    return table
