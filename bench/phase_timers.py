"""Timers around an engine's methods, for the benches that split a step into its phases."""
from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def timed_methods(acc: dict[str, float], targets):
    """Within the block, each ``(obj, name, key)`` method adds its wall seconds to ``acc[key]``; the
    methods are put back afterwards (no instance attribute is left behind)."""
    saved = []
    for obj, name, key in targets:
        fn = getattr(obj, name)
        saved.append((obj, name, vars(obj).get(name)))  # None: the attribute came from the class

        def timed(*a, _fn=fn, _key=key, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[_key] = acc.get(_key, 0.0) + time.perf_counter() - t
        setattr(obj, name, timed)
    try:
        yield acc
    finally:
        for obj, name, own in saved:
            if own is None:
                delattr(obj, name)  # a bound method kept on the instance would be a reference cycle
            else:
                setattr(obj, name, own)
