"""Errors a caller of the engine may need to tell apart (plain Python: the worker imports this
without torch)."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can run no further step: a tensor-parallel rank died (its shard of the weights
    and of the KV cache is gone). A worker must exit rather than retry, so that its jobs are
    reclaimed by workers whose engines still run."""
