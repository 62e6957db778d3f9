"""Errors a producer-side caller tells apart, whatever front end it serves.

The Batch API's objects (``producer.bulk.batches``), bulk input lines and OpenAI's message
shapes raise these; the gateway maps each to its HTTP status in one place
(``producer.gateway.errors``), and the bulk path turns them into error lines.
"""
from __future__ import annotations


class RequestError(ValueError):
    """A request that cannot run as given: what is wrong, the field it is about (``param``), a short code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class NotFound(LookupError):
    """No such object (or not one the caller may see): ``what`` and the id asked for."""

    def __init__(self, what: str, ident: str, param: str | None = None) -> None:
        self.message = f"No such {what}: '{ident}'"
        super().__init__(self.message)
        self.what, self.ident, self.param = what, ident, param
