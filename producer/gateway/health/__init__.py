"""``/health`` and ``/metrics`` (no API key: probes and scrapers)."""
