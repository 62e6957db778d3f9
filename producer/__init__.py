"""Producer side of pagestream, in four parts; never imports torch.

- ``producer.protocol``: the Redis contract every process shares (schema, key names, wire
  format, lanes, limits, untrusted parsing, Redis connections, settings). Workers import this.
- ``producer.client``: ``Producer`` / ``AsyncProducer`` and the operations commands.
- ``producer.gateway``: the OpenAI-compatible HTTP server (a producer like any other).
- ``producer.bulk``: bulk dataset jobs (spec, input/output lines, storage, S3, finalize,
  orchestrator on RQ) and OpenAI's Files and Batch objects over them.

The short forms below load lazily, so ``from pagestream.producer.protocol import keys`` loads
neither the client nor asyncio, and ``from pagestream.producer import Producer`` still works.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_CLIENT = "pagestream.producer.client"
_SCHEMA = "pagestream.producer.protocol.schema"
_EXPORTS = {
    "AsyncProducer": _CLIENT,
    "JobNotFound": _CLIENT,
    "ModelNotServed": _CLIENT,
    "Producer": _CLIENT,
    "ChatMessage": _SCHEMA,
    "JobRequest": _SCHEMA,
    "JobResult": _SCHEMA,
    "JobStatus": _SCHEMA,
    "Lane": _SCHEMA,
    "OutputTarget": _SCHEMA,
    "SampleResult": _SCHEMA,
    "SamplingOptions": _SCHEMA,
    "TokenEvent": _SCHEMA,
    "TokenLogprob": _SCHEMA,
    "TopLogprob": _SCHEMA,
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from pagestream.producer.client import AsyncProducer, JobNotFound, ModelNotServed, Producer
    from pagestream.producer.protocol.schema import (
        ChatMessage, JobRequest, JobResult, JobStatus, Lane, OutputTarget, SampleResult, SamplingOptions, TokenEvent,
        TokenLogprob, TopLogprob,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagestream.producer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
