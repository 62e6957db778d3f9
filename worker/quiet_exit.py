"""Leave the interpreter without triton's refleak report.

triton's extension is built with nanobind, which at interpreter shutdown lists every object of its
types still alive (``nanobind: leaked 4 instances!`` and a line per instance: triton's module-level
caches keep IR attributes and types until the end). Nothing has leaked in any sense that matters
at exit, but the report buries the worker's last line. ``quiet_exit`` does what a normal exit does
for Python code (``atexit`` handlers, logging's flush, stdio flush) and then ``os._exit``s, so
nanobind's shutdown hook never runs; processes that never loaded triton exit normally.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys


def exit_status(code: object) -> int:
    """What ``sys.exit(code)`` would leave as the exit status (a message is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def quiet_exit(code: object = 0) -> None:
    status = exit_status(code)
    if "triton" not in sys.modules:
        sys.exit(status)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
