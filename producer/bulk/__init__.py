"""Bulk dataset generation: spec and API, input/output lines, storage (local, S3), finalize, the
orchestrator that RQ runs, and OpenAI's Files and Batch objects over bulks."""
