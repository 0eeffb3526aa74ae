"""One error model everywhere: OpenAI's ``{"error": {"message", "type", "param", "code"}}``.

Messages name the offending field and never carry server paths, tracebacks or request
text; unexpected exceptions are logged on the server and answered with a generic 500.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragsnap.errors import RagSnapError

logger = logging.getLogger("ragsnap.api")

OPENAI_PREFIX = "/v1/chat/completions"
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error answered as-is: HTTP ``status``, a message naming ``param`` where there is one."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def from_ragsnap_error(exc: RagSnapError, prefix: str = "") -> ApiError:
    """A user error raised by the engine or a press as a 422 naming its field."""
    param = f"{prefix}{exc.field}" if exc.field else (prefix.rstrip(".") or None)
    return ApiError(422, exc.message, param=param, code="invalid_value")


def field_path(loc: Sequence[int | str]) -> str:
    """``("body", "documents", 2, "text")`` -> ``"documents[2].text"``."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


# FastAPI's detail for a body it cannot even decode (bytes that are not UTF-8)
BODY_NOT_PARSED = "There was an error parsing the body"
NOT_JSON = ApiError(422, "the request body is not valid JSON", param="body", code="json_invalid")


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return NOT_JSON
    param = field_path(first.get("loc", ())) or "body"
    detail = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    message = f"{param}: {detail}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    code = "missing_field" if first.get("type") == "missing" else "invalid_value"
    return ApiError(422, message, param=param, code=code)


def _status_for(request: Request, status: int) -> int:
    # the OpenAI route answers bad input with 400, as OpenAI does
    if status == 422 and request.url.path.startswith(OPENAI_PREFIX):
        return 400
    return status


def error_response(request: Request, error: ApiError) -> JSONResponse:
    status = _status_for(request, error.status)
    body = error_body(status, error.message, error.param, error.code)
    state = request.scope.setdefault("state", {})
    state.setdefault("log", {})["error"] = error.code or str(status)
    return JSONResponse(body, status_code=status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, _validation_error(exc))

    @app.exception_handler(RagSnapError)
    async def _ragsnap(request: Request, exc: RagSnapError) -> JSONResponse:
        return error_response(request, from_ragsnap_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == BODY_NOT_PARSED:  # e.g. not UTF-8
            return error_response(request, NOT_JSON)
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(request, ApiError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(
            request, ApiError(500, "internal server error", code="internal_error")
        )
