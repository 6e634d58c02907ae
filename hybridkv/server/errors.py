"""OpenAI-shaped errors: one exception type, one JSON body, handlers for everything else.

Every failure a client can cause ends here as ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status, because OpenAI clients parse that shape to raise their typed
exceptions (``BadRequestError``, ``NotFoundError``...). FastAPI's own 422 validation body
and Starlette's ``{"detail": ...}`` are replaced; an unexpected exception becomes a 500 that
says nothing about the code (the traceback goes to the server log only).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridkv.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# OpenAI's error "type" per status, as its API and the openai client name them.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request the server refuses; rendered by :func:`error_response`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    err_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    info = ErrorInfo(message=message, type=err_type, param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def error_response(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


# What a field of a union type accepts, for the one line its type error gets.
UNION_HINTS = {
    "prompt": "must be a string, a list of token ids, or a one-element list of either",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
}


def _is_branch(part: int | str) -> bool:
    """Pydantic names the union branch it tried in the loc (``str``, ``list[int]``)."""
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper()
    )


def _field_error(loc: Sequence[int | str], msg: str) -> tuple[str, str]:
    """(field name, line) of one error; a union's branch errors collapse to one hint."""
    parts = [p for p in loc if p != "body"]
    for i, part in enumerate(parts):
        if _is_branch(part):
            name = ".".join(str(p) for p in parts[:i])
            leaf = str(parts[i - 1]) if i else ""
            return name, f"{name}: {UNION_HINTS.get(leaf, 'has the wrong type')}"
    name = ".".join(str(p) for p in parts)
    return name, f"{name}: {msg}" if name else msg


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) summarising pydantic errors; one line per distinct field."""
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        reason = (detail.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {reason}".rstrip(": "), None
    if any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return (
            "the request body must be a JSON object, sent with Content-Type: application/json",
            None,
        )
    lines: list[str] = []
    params: list[str] = []
    for e in errors:
        msg = "field required" if e.get("type") == "missing" else e.get("msg", "invalid value")
        name, line = _field_error(e.get("loc", ()), msg)
        if name not in params:
            params.append(name)
        if line not in lines:
            lines.append(line)
    return "; ".join(lines[:5]) or "invalid request", (params[0] or None) if params else None


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(exc.errors())
    return error_response(message, 400, param)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.message, exc.status, exc.param, exc.code)


async def _http_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    if exc.status_code == 404:
        detail = f"no route {request.method} {request.url.path}"
    return JSONResponse(
        error_body(detail, exc.status_code), status_code=exc.status_code, headers=exc.headers
    )


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response("internal server error", 500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
