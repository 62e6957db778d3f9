"""Small helpers the gateway benches share (run as ``python bench/X.py``, so ``bench/`` is on the path)."""
from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port nothing listens on now (bound and released at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """A process's resident memory, MiB (``/proc/PID/status``'s VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
