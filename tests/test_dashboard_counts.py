"""The dashboard's bulk rows count as the Batch API does (no browser: tests/test_dashboard.py drives the page)."""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from pagestream.producer.gateway.dashboard.data import bulks
from pagestream.producer.protocol import keys
from pagestream.producer.protocol.bulk import BulkField, BulkStatus, request_counts
from pagestream.producer.protocol.tenants import OPEN


def test_a_cancelled_bulks_total_counts_its_skipped_lines_once(r, redis_url):
    # a cancelled bulk: 10 lines submitted, 2 invalid; 3 completed and 1 failed before the cancel skipped the other 6
    state = {BulkField.SUBMITTED: 10, BulkField.INVALID: 2, BulkField.COMPLETED: 3, BulkField.FAILED: 1,
             BulkField.SKIPPED: 6, BulkField.STATUS: BulkStatus.CANCELLED.value}
    r.hset(keys.bulk_hash("b-cancelled"), mapping=state)
    r.zadd(keys.bulk_index(), {"b-cancelled": 1})

    async def rows():
        async with aioredis.Redis.from_url(redis_url) as client:
            return await bulks(client, OPEN)

    (row,) = asyncio.run(rows())
    assert row["total"] == request_counts({k: str(v) for k, v in state.items()})["total"] == 12
    assert row["done"] == 12 and row["final"]  # every line accounted for, once
