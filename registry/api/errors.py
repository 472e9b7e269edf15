"""The one place where kiln errors become HTTP responses.

Every error body has the shape `{"error": {"code": ..., "message": ..., "details": {...}}}`;
request validation errors become `INVALID_INPUT` (422) in the same shape. The status of each code is the
catalog's (`core.error_codes`): its kind's, or the code's own.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.core.error_codes import CATALOG, Codes
from kiln.core.errors import KilnError, Unavailable

RETRY_AFTER_S = 5
# Codes whose status is not their kind's (a 410, a 413, ...): the catalog's, looked up first.
STATUS_BY_CODE: dict[str, int] = {entry.code: entry.http for entry in CATALOG.values() if entry.http is not None}

# The web framework's own errors, by status.
_CODE_BY_HTTP_STATUS = {
    400: Codes.BAD_REQUEST,
    404: Codes.NOT_FOUND,
    405: Codes.METHOD_NOT_ALLOWED,
    413: Codes.PAYLOAD_TOO_LARGE,
    415: Codes.UNSUPPORTED_MEDIA_TYPE,
}


def http_status(error: KilnError) -> int:
    """The HTTP status for a kiln error: its code's own, else its kind's (`Kind.http_status`)."""
    return STATUS_BY_CODE.get(error.code, error.kind.http_status)


def _printable(value: Any) -> Any:
    """`value` with every string made encodable: an error may quote input holding unpaired surrogates."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_printable(v) for v in value]
    return value


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"code": code, "message": message, "details": jsonable_encoder(details or {})}
    return {"error": _printable(body)}


def error_response(error: KilnError) -> JSONResponse:
    headers = {}
    if http_status(error) == 503:
        headers["Retry-After"] = str(RETRY_AFTER_S)  # outages of the database or blob store pass; try again
    if "hub_error_code" in error.details:  # Hub-compatible routes: what huggingface_hub maps to its errors
        headers["X-Error-Code"] = str(error.details["hub_error_code"])
        headers["X-Error-Message"] = error.message.encode("ascii", "replace").decode()[:1000]
    if error.code == Codes.RANGE_NOT_SATISFIABLE and "size" in error.details:
        headers["Content-Range"] = f"bytes */{error.details['size']}"
    return JSONResponse(
        error_body(error.code, error.message, error.details), status_code=http_status(error), headers=headers
    )


async def _kiln_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, KilnError)
    return error_response(exc)


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
    ]
    summary = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in problems)
    return JSONResponse(
        error_body(Codes.INVALID_INPUT, f"invalid request: {summary}", {"errors": problems}), status_code=422
    )


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _CODE_BY_HTTP_STATUS.get(exc.status_code, Codes.HTTP_ERROR)
    return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code, headers=dict(exc.headers or {}))


async def _database_unavailable(_request: Request, exc: Exception) -> JSONResponse:
    # The driver's message can hold connection details; name the failure, not the DSN.
    return error_response(Unavailable(f"database unavailable ({type(exc).__name__})"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(KilnError, _kiln_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OperationalError, _database_unavailable)
    app.add_exception_handler(InterfaceError, _database_unavailable)


class ErrorInfo(BaseModel):
    code: str = Field(description="stable machine-readable code, e.g. NOT_FOUND, EVAL_GATE_FAILED")
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class ErrorResponse(BaseModel):
    """The body of every error response."""

    error: ErrorInfo


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries for the error statuses a route can answer."""
    return {status: {"model": ErrorResponse} for status in statuses}
