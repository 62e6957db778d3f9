"""``/v1/files`` and ``/v1/batches``: OpenAI's Batch API over bulk jobs."""
