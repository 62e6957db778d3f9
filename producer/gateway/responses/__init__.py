"""``/v1/responses``: create (whole or streamed), retrieve, delete, cancel."""
