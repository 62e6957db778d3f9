"""Producer side of pagestream: job schema, Redis key names, clients. Never imports torch."""
from pagestream.producer.client import AsyncProducer, JobNotFound, ModelNotServed, Producer
from pagestream.producer.schema import (
    ChatMessage,
    JobRequest,
    JobResult,
    JobStatus,
    Lane,
    OutputTarget,
    SampleResult,
    SamplingOptions,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
)

__all__ = [
    "AsyncProducer",
    "JobNotFound",
    "ModelNotServed",
    "Producer",
    "ChatMessage",
    "JobRequest",
    "JobResult",
    "JobStatus",
    "Lane",
    "OutputTarget",
    "SampleResult",
    "SamplingOptions",
    "TokenEvent",
    "TokenLogprob",
    "TopLogprob",
]
