"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause maps to a 4xx here; a 500 means a bug in tokenmill.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.batch.storage import StoreBusy, StoreFull
from tokenmill.engine.api import (AdmissionError, EngineBusy, EngineDeadError, EngineHungError, InvalidParameter,
                                  ModelUnavailable, UnknownModel)

log = logging.getLogger("tokenmill.server")

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
    413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    499: "client_closed_request", 500: "server_error", 503: "service_unavailable", 504: "timeout",
    507: "insufficient_storage",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.type = type_ or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


def _loc_to_param(loc: tuple) -> str | None:
    """The top-level field at fault (pydantic's loc also names union members and indexes)."""
    parts = [str(p) for p in loc if p != "body"]
    return parts[0] if parts else None


def validation_error(errors: list) -> APIError:
    """A pydantic validation failure as the 400 naming the field at fault."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON")
    raised = (first.get("ctx") or {}).get("error")
    if isinstance(raised, InvalidParameter):  # a body's own check (a model validator) names its parameter
        return APIError(400, str(raised), param=raised.param)
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        msg = f"missing required parameter: {param!r}"
    elif param:
        msg = f"invalid value for {param!r}: {msg}"
    return APIError(400, msg, param=param)


def as_api_error(exc: Exception) -> APIError | None:
    """The client-facing error for an exception a request can raise, or None for a bug."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParameter):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, AdmissionError):
        return APIError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, UnknownModel):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, EngineBusy):
        return APIError(503, str(exc), code="engine_busy", headers={"Retry-After": "1"})
    if isinstance(exc, ModelUnavailable):
        headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.retry_after is not None else None
        return APIError(503, str(exc), param="model", code=exc.code, headers=headers)
    if isinstance(exc, StoreFull):  # 507 Insufficient Storage (RFC 4918): the server's disk, not the request
        return APIError(507, str(exc), code="insufficient_storage", headers={"Retry-After": "60"})
    if isinstance(exc, StoreBusy):
        return APIError(503, str(exc), code="store_busy", headers={"Retry-After": "1"})
    if isinstance(exc, EngineHungError):  # (a restart follows: a retry finds the new engine)
        return APIError(503, str(exc), code="engine_hung", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "1"})
    if isinstance(exc, (RequestValidationError, ValidationError)):
        return validation_error(exc.errors())
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    @app.exception_handler(InvalidParameter)
    @app.exception_handler(AdmissionError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineBusy)
    @app.exception_handler(UnknownModel)
    @app.exception_handler(ModelUnavailable)
    @app.exception_handler(StoreBusy)
    @app.exception_handler(RequestValidationError)
    async def _client_error(_: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error (a tokenmill bug)")
        return APIError(500, "internal server error").response()
