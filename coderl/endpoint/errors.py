"""Errors in OpenAI's shape, in one place, for ``coderl serve`` and the gateway.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` (the shape the official
``openai`` client reads into ``APIStatusError.body``): ``message`` one line, ``type``
``NotFoundError`` for a 404 (as vLLM types it), ``invalid_request_error`` for any other 4xx,
``server_error`` for a 5xx, ``param`` the request field at fault (None when no one field is),
``code`` the HTTP status (as vLLM sets it). :func:`install_error_handlers` gives an app's
unknown paths (404), wrong methods (405), FastAPI's validation errors (422) and every
``HTTPException`` this shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(HTTPException):
    """An ``HTTPException`` that names the request field at fault (``param``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(status, message)
        self.param = param


def error_response(
    status: int, message: str, *, param: str | None = None, headers: Any = None
) -> JSONResponse:
    """An OpenAI-shaped error body with HTTP status ``status`` (see the module docstring)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    kind = "NotFoundError" if status == 404 else kind
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status, headers=headers)


def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message, where = str(exc.detail), f"{request.method} {request.url.path}"
    if exc.status_code == 404 and message == "Not Found":  # the router's: no such path
        message = f"no such endpoint: {where}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "?")
        message = f"method not allowed: {where} (allowed: {allowed})"
    return error_response(
        exc.status_code, message, param=getattr(exc, "param", None), headers=exc.headers
    )


def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors]
    param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return error_response(400, "; ".join(parts), param=param)


def install_error_handlers(app: FastAPI) -> FastAPI:
    """Make every error ``app`` answers OpenAI-shaped: 404 for an unknown path, 405 for a wrong
    method, 400 for FastAPI's request validation (422 by default; OpenAI answers 400) and each
    ``HTTPException`` (``param`` from an :class:`ApiError`). Returns ``app``."""
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    return app
