"""Producers: ``Producer`` (redis-py) and ``AsyncProducer`` (redis.asyncio) over one core."""
from pagestream.producer.client.producer import (
    AsyncJobEvents,
    AsyncProducer,
    JobEvents,
    JobNotFound,
    ModelNotServed,
    Producer,
    build_request,
)

__all__ = ["AsyncJobEvents", "AsyncProducer", "JobEvents", "JobNotFound", "ModelNotServed", "Producer", "build_request"]
