"""SIGTERM/SIGINT for the worker loop: the first asks for a warm stop, the second for a cold one."""
from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


@contextmanager
def stop_signals(on_signal: Callable[[], bool]) -> Iterator[None]:
    """While inside, SIGTERM/SIGINT call ``on_signal`` (which returns True for a cold stop);
    the previous handlers come back on the way out. Off the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:  # noqa: ARG001
        cold = on_signal()
        log.warning("%s: %s stop", signal.Signals(signum).name, "cold" if cold else "warm")

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
