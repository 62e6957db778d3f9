"""pagestream: queue-fed LLM batch inference.

The repository's top-level folders install as ``pagestream.engine``, ``pagestream.producer``,
``pagestream.worker`` and ``pagestream.kernels``. The short forms below load lazily, so
``from pagestream import Producer`` in a producer-only install never imports torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagestream.engine",
    "LLMEngine": "pagestream.engine",
    "EngineConfig": "pagestream.engine",
    "SamplingParams": "pagestream.engine",
    "StructuredOutputsParams": "pagestream.engine",
    "Producer": "pagestream.producer",
    "AsyncProducer": "pagestream.producer",
    "JobRequest": "pagestream.producer",
    "JobResult": "pagestream.producer",
    "JobStatus": "pagestream.producer",
    "Lane": "pagestream.producer",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from pagestream.engine import LLM, EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
    from pagestream.producer import AsyncProducer, JobRequest, JobResult, JobStatus, Lane, Producer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagestream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
