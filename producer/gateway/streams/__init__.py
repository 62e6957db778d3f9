"""GET /v1/streams/{job_id}: resume a streamed request after Last-Event-ID."""
