"""Every error the API answers, in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}`` (what the ``openai`` client reads
into ``APIStatusError.body``), including FastAPI's own validation errors and 404s."""

from __future__ import annotations

import enum
import logging
from typing import Any

import asyncpg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from temporalio.service import RPCError, RPCStatusCode

from llmbatch.errors import LlmBatchError

log = logging.getLogger(__name__)


class ErrorType(enum.StrEnum):
    """OpenAI's ``error.type`` values that this API answers."""

    # OpenAI answers a bad or missing key with this type too (and code invalid_api_key).
    INVALID_REQUEST = "invalid_request_error"
    RATE_LIMIT = "rate_limit_error"
    SERVER = "server_error"


class ApiError(LlmBatchError):
    """An answer other than success: raised anywhere in a request, rendered by the app."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: ErrorType = ErrorType.INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


# How long a request waits on Postgres or Temporal before it answers 503.
BACKEND_TIMEOUT_S = 5.0
# What a 503 tells the caller to wait before trying again.
RETRY_AFTER_S = 5

# The database or Temporal is away (refused, reset, timed out): the request may work
# later, so 503 with Retry-After, as OpenAI's clients retry those.
_BACKEND_DOWN: tuple[type[BaseException], ...] = (
    OSError,  # ConnectionRefusedError and friends
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
)
_TEMPORAL_DOWN = (
    RPCStatusCode.UNAVAILABLE,
    RPCStatusCode.DEADLINE_EXCEEDED,
    RPCStatusCode.CANCELLED,
    RPCStatusCode.RESOURCE_EXHAUSTED,
)


def backend_down(exc: BaseException) -> bool:
    """Whether ``exc`` says Postgres or Temporal is away, not that the request is bad."""
    if isinstance(exc, RPCError):
        return exc.status in _TEMPORAL_DOWN
    return isinstance(exc, _BACKEND_DOWN)


def not_found(kind: str, object_id: str, *, param: str = "id") -> ApiError:
    """404 for an id this project does not have (another project's id included)."""
    return ApiError(404, f"No such {kind} object: {object_id}", param=param, code="not_found")


def refuse_nul(request: Request) -> None:
    """Refuse a NUL in the path or query (a router dependency): Postgres text cannot
    hold one, so it could name nothing; a path id with one is not found (404), a query
    parameter with one is invalid (400)."""
    for name, value in request.path_params.items():
        if isinstance(value, str) and "\x00" in value:
            raise ApiError(
                404, f"No such object: {name} holds a NUL.", param=name, code="not_found"
            )
    for name, value in request.query_params.multi_items():
        if "\x00" in name or "\x00" in value:
            raise ApiError(
                400, f"Query parameter {name!r} holds a NUL.", param=name, code="invalid_value"
            )


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _answer(
    status: int,
    message: str,
    *,
    type: ErrorType = ErrorType.INVALID_REQUEST,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(message, type=type, code=code), status_code=status, headers=headers
    )


def install_handlers(app: FastAPI) -> None:
    """Render every error in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(
            error_body(exc.message, type=exc.type, param=exc.param, code=exc.code),
            status_code=exc.status,
            headers=headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        # ("body", "metadata", "k") -> "metadata.k": the field as the caller named it.
        where = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(where) or None
        message = first.get("msg", "invalid request")
        return JSONResponse(
            error_body(
                f"{param}: {message}" if param else str(message),
                type=ErrorType.INVALID_REQUEST,
                param=param,
                code="invalid_value",
            ),
            status_code=400,
        )

    @app.exception_handler(asyncpg.CharacterNotInRepertoireError)
    @app.exception_handler(asyncpg.UntranslatableCharacterError)
    async def _bad_text(request: Request, exc: Exception) -> JSONResponse:
        # A caller's text Postgres cannot hold (a NUL) that a check above missed: the
        # caller's fault, so 400, never a 500.
        log.warning("%s %s: text refused by Postgres: %s", request.method, request.url.path, exc)
        return _answer(
            400,
            "A parameter holds characters that cannot be stored (such as NUL).",
            code="invalid_value",
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own: an unknown route (404), a wrong method (405).
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}"
        return JSONResponse(
            error_body(message, type=ErrorType.INVALID_REQUEST),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    async def _backend(request: Request, exc: Exception) -> JSONResponse:
        if not backend_down(exc):
            return await _unexpected(request, exc)
        log.warning("%s %s: a backend is away: %r", request.method, request.url.path, exc)
        return _answer(
            503,
            "The service is temporarily unavailable; retry in a few seconds.",
            type=ErrorType.SERVER,
            code="service_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    # Each class of its own: the catch-all below is Starlette's last resort, which
    # re-raises after answering, and the connection is dropped.
    for kind in (*_BACKEND_DOWN, RPCError):
        app.add_exception_handler(kind, _backend)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The message names no internals (DSNs, hosts): those go to the server's log.
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(
            error_body("The server had an error processing your request.", type=ErrorType.SERVER),
            status_code=500,
        )
