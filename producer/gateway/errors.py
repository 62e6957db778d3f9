"""Every error the gateway answers, in OpenAI's shape, mapped to HTTP in this one place.

Routes and serving classes raise ``GatewayError`` (an HTTP answer) or a domain error
(``producer.protocol.errors``: ``RequestError`` -> 400, ``NotFound`` -> 404); ``install``
puts the handlers on the app, including Starlette's own (unknown path, wrong method).
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagestream.producer.protocol.errors import NotFound, RequestError


class GatewayError(Exception):
    """An error the client sees in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s  # a 429's retry-after header

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def http_error(exc: Exception) -> GatewayError:
    """The HTTP answer for a domain error (``GatewayError`` as it is)."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, RequestError):
        return GatewayError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, NotFound):
        return GatewayError(404, exc.message, param=exc.param, code="not_found")
    raise TypeError(f"no HTTP mapping for {type(exc).__name__}")  # a bug: Accounting answers it with a 500


def install(app: FastAPI) -> None:
    """The exception handlers of the gateway app."""

    async def domain(request: Request, exc: Exception) -> JSONResponse:
        return http_error(exc).response()

    async def starlette(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return GatewayError(exc.status_code, str(exc.detail), code=code).response()

    for cls in (GatewayError, RequestError, NotFound):
        app.add_exception_handler(cls, domain)
    app.add_exception_handler(StarletteHTTPException, starlette)
