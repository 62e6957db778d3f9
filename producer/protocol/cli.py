"""What every ``pagestream`` command shares: the ``--redis-url`` option, exit statuses, one-line errors.

Exit status: 0 done, 1 the job or bulk did not complete, 2 bad input or not found,
3 Redis unreachable. Expected failures print one ``error: ...`` line on stderr, no traceback.
"""
from __future__ import annotations

from typing import NoReturn, Optional

import typer

from pagestream.producer.protocol.settings import DEFAULT_REDIS_URL, REDIS_URL_ENV, redis_url

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_REDIS_DOWN = 3


def redis_url_option() -> Optional[str]:
    return typer.Option(None, "--redis-url", envvar=list(REDIS_URL_ENV), show_envvar=True,
                        show_default=DEFAULT_REDIS_URL, help="Redis URL")


def resolve_url(url: str | None) -> str:
    return redis_url(url)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """One line on stderr and a non-zero exit."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
