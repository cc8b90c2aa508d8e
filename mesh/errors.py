"""Errors a client sees, in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure path of the gateway ends in ``MeshError`` (or one of FastAPI's own exceptions,
translated by the handlers installed here), so a client never sees a bare 500 or a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from mesh.log_limit import LogLimiter

log = logging.getLogger("mesh.errors")
# Tracebacks of unexpected errors, a few per route and exception type per minute: a request that
# trips a bug can be sent in a loop, and each traceback is kilobytes.
_unexpected = LogLimiter(log, "unexpected errors on")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

_encode = msgspec.json.Encoder().encode


class MeshError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def to_bytes(self) -> bytes:
        return _encode(self.body())

    def response(self) -> Response:
        return Response(self.to_bytes(), self.status, self.headers, media_type="application/json")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class Error(BaseModel):
    """The OpenAI error shape, for the OpenAPI schema (``error_responses``)."""

    error: ErrorDetail


def error_responses(statuses: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` documenting ``statuses`` (status -> when) as OpenAI errors."""
    return {status: {"model": Error, "description": when} for status, when in statuses.items()}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ERROR_SNIPPET = 200  # characters of a worker's non-OpenAI error body quoted in a rewrapped error


def openai_error_bytes(status: int, prefix: str, body: bytes | None, code: str = "upstream_error") -> bytes:
    """A worker's error answer for the client: ``body`` itself when it is in the OpenAI shape, else
    an OpenAI error of ``status`` whose message is ``prefix`` quoting it, so a client never sees an
    HTML page, a bare text, an empty body, FastAPI's ``{"detail": ...}`` or vLLM's flat
    ``{"object": "error", "message": ...}`` (the proxy's and the disaggregated relay's rule)."""
    try:
        value = msgspec.json.decode(body) if body else None
    except (msgspec.MsgspecError, RecursionError):
        value = None
    if isinstance(value, dict) and isinstance(value.get("error"), dict) and isinstance(value["error"].get("message"), str):
        return body  # type: ignore[return-value]
    detail = value.get("message", value.get("detail")) if isinstance(value, dict) else None
    if detail is None:
        detail = (body or b"").decode("utf-8", "replace").strip()
    elif not isinstance(detail, str):
        detail = msgspec.json.encode(detail).decode()
    return MeshError(status, f"{prefix}: {detail[:ERROR_SNIPPET]}" if detail else prefix, code=code).to_bytes()


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> MeshError:
    return MeshError(400, message, param=param, code=code)


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """The clean end of a stream that failed after its first byte: an error event, then [DONE]."""
    return b"data: " + _encode(error_body(message, "upstream_error", None, code)) + b"\n\ndata: [DONE]\n\n"


def install_handlers(app: FastAPI) -> None:
    """Translate every exception FastAPI/Starlette can raise into the OpenAI shape."""

    async def mesh_error(_: Request, exc: MeshError) -> Response:
        return exc.response()

    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors[:5])
        return MeshError(422, message or "invalid request", param=".".join(loc) or None, code="validation_error").response()

    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        headers = dict(exc.headers or {})
        return MeshError(exc.status_code, detail, code=code, headers=headers).response()

    async def unexpected(request: Request, exc: Exception) -> Response:
        _unexpected.log(logging.ERROR, (request.url.path, type(exc).__name__), "unexpected error: %s", exc, exc_info=True)
        return MeshError(500, "internal gateway error", code="internal_error").response()

    app.add_exception_handler(MeshError, mesh_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)
