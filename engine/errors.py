"""Errors a caller of the engine may need to tell apart (plain Python: the worker imports this
without torch)."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can run no further step: its core process (``engine.engine_process``) or a
    tensor-parallel rank died (with its shard of the weights and of the KV cache). A worker must exit rather than retry, so that its jobs are
    reclaimed by workers whose engines still run."""
