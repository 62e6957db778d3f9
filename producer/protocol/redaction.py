"""Keep credentials out of what pagestream prints and logs.

Redis and S3 URLs carry passwords (``redis://:secret@host``, ``rediss://user:secret@host``).
``redact_url`` masks one URL where the code prints it on purpose; ``install_log_redaction``
puts a filter on every root handler so that a URL with credentials in *any* log record
(ours, redis-py's, a traceback's) reaches the log with its password masked.
"""
from __future__ import annotations

import logging
import re

#: ``scheme://user:password@`` or ``scheme://:password@``: the password part is masked
_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^:@/\s]*):(?P<password>[^@/\s]+)@")
MASK = "***"


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``."""
    if "://" not in text:
        return text
    return _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)


def redact_url(url: str | None) -> str | None:
    """One URL with its password masked (``redis://:***@host:6379/0``); ``None`` stays ``None``."""
    return None if url is None else redact(url)


class RedactingFilter(logging.Filter):
    """Masks URL passwords in a record's final message and in its formatted traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Attach one ``RedactingFilter`` to every handler of ``logger`` (the root by default)."""
    logger = logger or logging.getLogger()
    for handler in logger.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
