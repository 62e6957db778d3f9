"""Producer side of pagestream: job schema, Redis key names, clients. Never imports torch."""
from producer.schema import (
    ChatMessage,
    JobRequest,
    JobResult,
    JobStatus,
    Lane,
    OutputTarget,
    SampleResult,
    SamplingOptions,
    TokenEvent,
)

__all__ = [
    "ChatMessage",
    "JobRequest",
    "JobResult",
    "JobStatus",
    "Lane",
    "OutputTarget",
    "SampleResult",
    "SamplingOptions",
    "TokenEvent",
]
