"""How big a job may be: safe defaults, each one configurable from the environment.

``JobRequest`` checks these when it is built, so a producer's ``submit`` refuses an
oversized job before it reaches Redis, and a worker (which validates every lane entry
with ``JobRequest``) refuses one that was written to the stream by hand. A limit is
changed with ``PAGESTREAM_<FIELD>`` (``PAGESTREAM_MAX_PROMPT_BYTES=4194304``); set it
the same on producers and workers, or the stricter side refuses with the same message.
"""
from __future__ import annotations

from functools import cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024


class JobLimits(BaseSettings):
    """Upper bounds on one job. Env: the field name upper-cased with ``PAGESTREAM_`` in front."""

    model_config = SettingsConfigDict(env_prefix="PAGESTREAM_", extra="ignore")

    #: UTF-8 bytes of ``prompt``, or of all message contents together (a 128k-token context is ~0.5 MiB)
    max_prompt_bytes: int = Field(1 * MiB, ge=1)
    #: length of ``prompt_token_ids``
    max_prompt_token_ids: int = Field(262_144, ge=1)
    #: number of chat messages
    max_messages: int = Field(2_048, ge=1)
    #: ``metadata`` as compact JSON, in UTF-8 bytes; it is copied into every result
    max_metadata_bytes: int = Field(64 * 1024, ge=2)
    #: nesting of ``metadata`` (an object holding an object is depth 2)
    max_metadata_depth: int = Field(8, ge=1, le=32)
    #: stop strings are checked against every new token of the job, so both count and length are bounded
    max_stop_strings: int = Field(32, ge=0)
    max_stop_string_bytes: int = Field(256, ge=1)
    max_stop_token_ids: int = Field(256, ge=0)
    #: a job's ``structured_outputs`` (schema, regex, choices or grammar) as JSON, in UTF-8 bytes
    max_structured_output_bytes: int = Field(64 * 1024, ge=64)
    #: a chat job's ``chat_template`` (a Jinja template sent with the request), in UTF-8 bytes
    max_chat_template_bytes: int = Field(64 * 1024, ge=1)
    #: a chat job's ``chat_template_kwargs`` as compact JSON, in UTF-8 bytes
    max_chat_template_kwargs_bytes: int = Field(16 * 1024, ge=2)
    #: ``max_tokens`` (and ``min_tokens``) per sample
    max_tokens: int = Field(131_072, ge=1)
    #: samples per job
    max_n: int = Field(16, ge=1)
    #: how long a job's result and token stream are kept after it ends (30 days)
    max_result_ttl_s: int = Field(30 * 24 * 3600, ge=1)

    @property
    def max_entry_bytes(self) -> int:
        """Upper bound on the JSON of any job these limits accept: a lane entry or bulk input line
        longer than this cannot hold a valid job, so readers refuse it before parsing.

        Worst cases: every prompt byte JSON-escaped as ``\\u00XX`` (6 bytes), ~40 bytes of
        framing per message, 11 characters per token id; plus stop strings, metadata
        (twice: float formatting differs between serializers), a structured-output spec, a chat template
        and its kwargs (escaped) and 64 KiB for the rest.
        """
        prompt = max(6 * self.max_prompt_bytes + 40 * self.max_messages, 11 * self.max_prompt_token_ids)
        stops = 6 * self.max_stop_strings * (self.max_stop_string_bytes + 3) + 11 * self.max_stop_token_ids
        structured = 6 * self.max_structured_output_bytes
        template = 6 * (self.max_chat_template_bytes + self.max_chat_template_kwargs_bytes)
        return prompt + stops + 2 * self.max_metadata_bytes + structured + template + 64 * 1024


@cache
def job_limits() -> JobLimits:
    """The limits of this process, read from the environment once (``job_limits.cache_clear()`` re-reads)."""
    return JobLimits()
