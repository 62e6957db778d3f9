"""Per-tenant limits (issue 22): what one tenant may have open at once, and the Redis state they count.

A tenant's limits (``TenantLimits``) bound its **queued jobs** (accepted and not final: waiting or
running), its **queued tokens** (the same jobs' prompt tokens + ``max_tokens`` x ``n``), its
**concurrent streams** (SSE responses open on any gateway) and its **open batches** (not final). The
gateway's settings give one default for every tenant and overrides per tenant name
(``tenant_limits``, key ``*`` = the default); an unset field is no limit.

Counting. Each limit counts a per-tenant index of open work, kept in Redis under the tenant's hash tag
(``keys.tenant_open_*``), so every gateway sees the same counts and one script admits atomically:

- ``ADMIT_LUA`` checks every limit a request touches and, only if all hold, adds its jobs (with
  their tokens) and its stream at once: two gateways admitting at the same moment cannot both take the
  last slot, and a refused request has written nothing.
- ``RELEASE_JOBS_LUA`` removes jobs and subtracts their tokens; a job not in the index is skipped, so
  releasing twice (the gateway that waited on it, then a sweep) never counts it out twice.
- The job hash's status is the truth: a gateway releases a job as soon as it sees the job final, and
  a tenant found at a limit has its index swept (each job's status read; final or gone ones released)
  before it is refused (at most twice a second per tenant and gateway), so jobs a killed gateway
  admitted, or whose client left, stop counting once they end, without any writer outside the gateway
  knowing about limits. A job admitted moments ago
  whose hash is not written yet is kept (``SUBMIT_GRACE_MS``).
- Streams are leases (score = expiry): the gateway renews each open stream's lease; a killed
  gateway's streams stop counting when theirs run out (``STREAM_LEASE_MS``).
- Batches: like jobs, admitted before the bulk is created, released when it is seen final or gone.
"""
from __future__ import annotations

import math
import re

from pydantic import BaseModel, ConfigDict, Field

from pagestream.producer.protocol.schema import JobRequest
from pagestream.producer.protocol.tenants import TENANT_NAME

#: the key of ``tenant_limits`` that holds the default for every tenant
DEFAULT_TENANT = "*"
#: what a key of ``tenant_limits`` may be
TENANT_NAME_OR_DEFAULT = re.compile(rf"{TENANT_NAME.pattern}|^\*$")
#: how long an admitted job (or batch) whose hash is not written yet counts without a hash
SUBMIT_GRACE_MS = 60_000
#: an open stream's lease; its gateway renews it every third of this
STREAM_LEASE_MS = 15_000

#: which limit refused a request (ADMIT_LUA's answer)
JOBS, TOKENS, STREAMS, BULKS = "max_queued_jobs", "max_queued_tokens", "max_concurrent_streams", "max_open_batches"


class TenantLimits(BaseModel):
    """What one tenant may have open at once; ``None``: no limit."""

    model_config = ConfigDict(extra="forbid")

    max_queued_jobs: int | None = Field(None, ge=1)  # jobs accepted and not final (waiting or running)
    max_queued_tokens: int | None = Field(None, ge=1)  # those jobs' prompt tokens + max_tokens x n
    max_concurrent_streams: int | None = Field(None, ge=1)  # SSE responses open, on every gateway
    max_open_batches: int | None = Field(None, ge=1)  # batches not final
    retry_after_s: int = Field(1, ge=1)  # the 429's retry-after

    def over(self, other: "TenantLimits") -> "TenantLimits":
        """These limits, with the fields ``other`` sets replacing them (a tenant's override over the default)."""
        return self.model_copy(update={k: getattr(other, k) for k in other.model_fields_set})


class LimitTable:
    """tenant name -> its limits: the default (``*``) with the tenant's own override on top."""

    def __init__(self, table: dict[str, TenantLimits]) -> None:
        default = table.get(DEFAULT_TENANT, TenantLimits())
        self._default = default
        self._tenants = {name: default.over(lim) for name, lim in table.items() if name != DEFAULT_TENANT}

    def of(self, tenant: str) -> TenantLimits:
        return self._tenants.get(tenant, self._default)


def prompt_tokens(job: JobRequest) -> int:
    """A job's prompt size before any worker tokenized it: its token ids when given, else the text's UTF-8
    bytes / 4 rounded up (OpenAI's rule of thumb of 4 characters a token; chat messages' contents summed)."""
    if job.prompt_token_ids:
        return len(job.prompt_token_ids)
    if job.prompt is not None:
        text = job.prompt
    else:
        text = "".join(str(m.content or "") for m in job.messages or [])
    return max(1, math.ceil(len(text.encode()) / 4))


def job_tokens(job: JobRequest, context_len: int | None) -> int:
    """What a job counts against ``max_queued_tokens``: prompt + max_tokens (the context when unbounded) x n."""
    max_tokens = job.sampling.max_tokens
    if max_tokens is None:
        max_tokens = context_len or 0
    return prompt_tokens(job) + max_tokens * job.sampling.n


# KEYS: open jobs, job tokens, open streams. ARGV: now ms, max jobs, max tokens, max streams (-1: none),
# stream member ('' : none), stream lease expiry ms, then job id, tokens pairs.
# Returns {'' , 0} when admitted, else {limit name, what is in use}.
ADMIT_LUA = f"""
local now = tonumber(ARGV[1])
local max_jobs, max_tokens, max_streams = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local stream = ARGV[5]
if stream ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  local open = redis.call('ZCARD', KEYS[3])
  if max_streams >= 0 and open + 1 > max_streams then return {{'{STREAMS}', open}} end
end
local n, sum = 0, 0
for i = 7, #ARGV, 2 do n = n + 1; sum = sum + tonumber(ARGV[i + 1]) end
if n > 0 then
  local jobs = redis.call('ZCARD', KEYS[1])
  if max_jobs >= 0 and jobs + n > max_jobs then return {{'{JOBS}', jobs}} end
  local used = tonumber(redis.call('HGET', KEYS[2], 'total') or '0')
  if max_tokens >= 0 and used + sum > max_tokens then return {{'{TOKENS}', used}} end
  for i = 7, #ARGV, 2 do
    redis.call('ZADD', KEYS[1], now, ARGV[i])
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  end
  redis.call('HINCRBY', KEYS[2], 'total', sum)
end
if stream ~= '' then redis.call('ZADD', KEYS[3], tonumber(ARGV[6]), stream) end
return {{'', 0}}
"""

# KEYS: open jobs, job tokens. ARGV: job ids. Returns how many were still open (each is released once).
RELEASE_JOBS_LUA = """
local released = 0
for _, id in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[1], id) == 1 then
    local t = tonumber(redis.call('HGET', KEYS[2], id) or '0')
    redis.call('HDEL', KEYS[2], id)
    redis.call('HINCRBY', KEYS[2], 'total', -t)
    released = released + 1
  end
end
if redis.call('ZCARD', KEYS[1]) == 0 then redis.call('DEL', KEYS[2]) end
return released
"""

# KEYS: open batches. ARGV: now ms, max batches, batch id. Returns {'', 0} or {limit name, open}.
ADMIT_BULK_LUA = f"""
local open = redis.call('ZCARD', KEYS[1])
if open + 1 > tonumber(ARGV[2]) then return {{'{BULKS}', open}} end
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]), ARGV[3])
return {{'', 0}}
"""

#: the gateway's scripts, registered by name on its client
SCRIPTS = {"admit": ADMIT_LUA, "release_jobs": RELEASE_JOBS_LUA, "admit_bulk": ADMIT_BULK_LUA}
