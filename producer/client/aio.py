"""asyncio helpers the client and the gateway share."""
from __future__ import annotations

import asyncio


async def cancel_until_done(task: asyncio.Task, poll_s: float = 0.1) -> None:
    """Cancel ``task`` and wait for it to end, cancelling again each ``poll_s`` until it has: redis-py can
    swallow a cancel that lands while it checks a pooled connection (``asyncio.timeout(0)`` on Python
    3.11), and the blocking read that follows would otherwise hold a one-shot ``cancel(); await task``
    (and so a shutdown) for ever."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=poll_s)
