"""The one object the worker's threads share: the loop, the control thread, the publisher.

The loop holds lane entries from the read until their ack; the control thread keeps
their leases alive and tells the loop about cancels and lost leases; the publisher
says which entries it acked. Each of them goes through these methods, never through
another's fields, and the lock is held only to copy or swap a set.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

Entry = tuple[str, str]  # (lane, entry_id)


class LoopState:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[Entry] = set()  # read and not yet acked, except bulk results waiting on the sink
        self._cancels: set[str] = set()  # job ids the control thread saw on the cancel stream
        self._lost: set[Entry] = set()  # held entries another consumer took over
        self.stats_snapshot: dict[str, Any] = {}  # replaced whole by the loop, read by the control thread
        self.stopping = threading.Event()  # set at teardown: the control thread exits
        # Held across a lease refresh (the control thread: read the held entries, reset their idle times) and
        # across a release (the loop: hand entries back, idle past the lease, and stop holding them). Without it a
        # refresh that read an entry just before its release reset the idle time the release had set, and the
        # entry, still ours in the PEL, waited out a whole lease before another worker could take it.
        self.leases = threading.Lock()

    # -- held entries ----------------------------------------------------------------------

    def hold(self, entry: Entry) -> None:
        with self._lock:
            self._held.add(entry)

    def unhold(self, entries: Iterable[Entry]) -> None:
        with self._lock:
            self._held.difference_update(entries)

    def held(self) -> list[Entry]:
        with self._lock:
            return list(self._held)

    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    # -- events for the loop ----------------------------------------------------------------

    def request_cancel(self, job_id: str) -> None:
        with self._lock:
            self._cancels.add(job_id)

    def report_lost(self, entries: Iterable[Entry]) -> None:
        with self._lock:
            self._lost.update(entries)

    def pending_events(self) -> tuple[set[str], set[Entry]]:
        """Cancels and lost entries not yet taken by the loop (a copy)."""
        with self._lock:
            return set(self._cancels), set(self._lost)

    def take_events(self) -> tuple[set[str], set[Entry]]:
        """Cancels and lost entries since the last call; the loop acts on them before its next step."""
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            lost, self._lost = self._lost, set()
        return cancels, lost
