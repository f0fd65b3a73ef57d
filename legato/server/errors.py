"""Errors as OpenAI-shaped JSON: `{"error": {"message", "type", "param", "code"}}`.

Every refusal the server makes goes through here, so clients see one shape whatever refused them: our own
checks (`ApiError`), pydantic validation (always **400**, as OpenAI answers invalid parameters; never 422),
Starlette's HTTP errors (unknown route, wrong method, and the `HTTPException`s of other routers), and
unexpected exceptions (500, logged with their traceback). A client leaving mid-body is one log line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}


class ApiError(Exception):
    """A request the server refuses or failed. `code` is a short machine-readable reason."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error response (documented in the OpenAPI schema)."""

    error: ErrorDetail


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.code, exc.param), status_code=exc.status,
                        headers=exc.headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line for all of a request's validation errors, and the first offending field."""
    parts, param = [], None
    for err in exc.errors():
        whole = _whole_body_problem(err)
        if whole is not None:  # about the body itself, not a field: no `param`
            parts.append(whole)
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc)
        param = param or field or None
        parts.append(f"{field}: {err.get('msg')}" if field else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


def _whole_body_problem(err: dict) -> str | None:
    """A readable line for an error about the request body as a whole (bad JSON, no body, not an object), whose
    pydantic location names no field (for bad JSON it is a character offset, once reported as the field)."""
    kind, loc = err.get("type"), tuple(err.get("loc", ()))
    if kind == "json_invalid":
        at = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
        detail = (err.get("ctx") or {}).get("error") or err.get("msg")
        return f"the body is not valid JSON{f' (at character {at})' if at is not None else ''}: {detail}"
    if loc == ("body",) and kind == "missing":
        return "the request has no body: send a JSON object"
    if loc == ("body",) and kind in ("model_attributes_type", "dict_type"):
        return "the body must be a JSON object, sent as Content-Type: application/json"
    return None


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return JSONResponse(error_body(400, message, "invalid_request", param), status_code=400)

    async def on_client_disconnect(request: Request, exc: ClientDisconnect) -> Response:
        # The client left mid-body: nobody reads the answer, and nothing failed on our side.
        log.info("client disconnected during the request body of %s %s", request.method, request.url.path)
        return Response(status_code=499)

    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's body parsing wraps it in a 400
            return await on_client_disconnect(request, exc.__cause__)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return JSONResponse(error_body(exc.status_code, message, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(ClientDisconnect, on_client_disconnect)
    app.add_exception_handler(Exception, on_unexpected)
