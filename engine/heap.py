"""The garbage collector and a long-lived engine process (no torch import: the worker uses it too)."""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move every object alive now into the GC's permanent generation (``gc.freeze``), as vLLM does
    after start-up. An engine's process holds ~400k GC-tracked objects from torch, triton, transformers
    and the model, all as long-lived as the process; a full collection walks them all (0.2 s on the
    CPU VM), and one landing mid-run stalls the step loop. Frozen, a full collection walks only what
    was allocated since."""
    gc.collect()
    gc.freeze()
