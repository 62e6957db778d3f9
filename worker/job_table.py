"""The jobs one worker holds: buffered (pulled and checked, waiting for room in the engine) and running.

The loop, ``Intake`` and ``Results`` share this one object rather than a raw dict and
deque: intake buffers and starts jobs, results finishes them, the loop aborts and drains
them. Nobody else keeps a job id -> job map.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pagestream.worker.jobs import ActiveJob


class JobTable:
    def __init__(self) -> None:
        self._running: dict[str, ActiveJob] = {}  # job_id -> job in the engine
        self._buffered: deque[ActiveJob] = deque()
        # the hot path (every output of every step) looks running jobs up: a bound dict method
        self.get: Callable[[str], ActiveJob | None] = self._running.get

    # -- buffered: pulled, checked, not yet in the engine
    def buffer(self, a: ActiveJob) -> None:
        self._buffered.append(a)

    def next_buffered(self) -> ActiveJob | None:
        """The job that enters the engine next (left in the buffer)."""
        return self._buffered[0] if self._buffered else None

    def pop_buffered(self) -> ActiveJob:
        return self._buffered.popleft()

    def buffered(self) -> list[ActiveJob]:
        return list(self._buffered)

    def num_buffered(self) -> int:
        return len(self._buffered)

    def keep_buffered(self, keep: Callable[[ActiveJob], bool]) -> None:
        """Drop every buffered job ``keep`` says no to."""
        self._buffered = deque(a for a in self._buffered if keep(a))

    def take_buffered(self) -> list[ActiveJob]:
        """Empty the buffer (a stop or a failed read): the jobs that were in it."""
        out = list(self._buffered)
        self._buffered.clear()
        return out

    # -- running: in the engine
    def start(self, a: ActiveJob) -> None:
        """``a`` entered the engine."""
        self._running[a.job_id] = a

    def finish(self, job_id: str) -> ActiveJob | None:
        """``job_id`` left the engine (finished, aborted, failed): it is no longer running here."""
        return self._running.pop(job_id, None)

    def running(self) -> list[ActiveJob]:
        """A snapshot of the running jobs (safe to finish them while iterating)."""
        return list(self._running.values())

    def num_running(self) -> int:
        return len(self._running)

    # -- both
    def find(self, job_id: str) -> ActiveJob | None:
        """The job this worker holds under ``job_id``, running or buffered."""
        return self._running.get(job_id) or next((a for a in self._buffered if a.job_id == job_id), None)

    def num_in_flight(self) -> int:
        """Jobs held, running or buffered."""
        return len(self._running) + len(self._buffered)

    def __bool__(self) -> bool:
        return bool(self._running or self._buffered)

