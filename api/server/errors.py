"""Every refusal in OpenAI's error shape: {"error": {"message", "type", "param", "code"}},
with the status code OpenAI uses for it. No message ever holds a key."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specq.schema.errors import json_type, path

log = logging.getLogger(__name__)

TYPES = {401: "invalid_request_error", 429: "insufficient_quota", 500: "server_error"}
# on a 409 or 429 that the same request meets again, whenever it is sent: OpenAI's SDKs
# retry both unless told not to, and this header tells them
NO_RETRY = {"x-should-retry": "false"}


class ApiError(Exception):
    """A refusal: HTTP ``status``, a message for people, the request field it concerns
    (``param``) and a code for programs."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": shown(message), "type": kind,
                      "param": None if param is None else shown(param), "code": code}}


def shown(text: str) -> str:
    """``text`` as UTF-8 can carry it: a lone surrogate (from a JSON escape or a path)
    written as its escape, never an error while answering."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def respond(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def not_found(what: str, ident: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No such {what}: '{ident[:100]}'", param=param,
                    code=f"{what.lower()}_not_found".replace(" ", "_"))


def install(app: FastAPI) -> None:
    """The handlers that turn every error, FastAPI's and Starlette's included, into the
    OpenAI shape."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = (exc.errors() or [{}])[0]
        kind = request.headers.get("content-type", "")
        if tuple(err.get("loc", ())) == ("body",) and kind and "json" not in kind.lower():
            return respond(ApiError(  # FastAPI parses JSON only when the type says JSON
                400, "The request body must be JSON, sent with Content-Type: "
                f"application/json (this one's is {kind[:80]!r})", code="invalid_content_type"))
        param = path([p for p in err.get("loc", ()) if p not in ("body", "query")]) or None
        if err.get("type") == "json_invalid":
            message = ("We could not parse the JSON body of your request: "
                       f"{err.get('ctx', {}).get('error', 'not valid JSON')}")
            return respond(ApiError(400, message, code="invalid_json"))
        message = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
        if tuple(err.get("loc", ())) == ("body",):  # no body, or not an object: say so
            given = err.get("input")
            message = ("The request needs a JSON object as its body; none was sent"
                       if err.get("type") == "missing" or given is None else
                       f"The request's body must be a JSON object, got {json_type(given)}")
        elif param and err.get("type") == "missing":
            message = f"Missing required parameter: '{param}'."
        elif param:
            message = f"{param}: {message}"
        return respond(ApiError(400, message, param=param, code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path[:200]})"
            return respond(ApiError(404, message, code="unknown_url"))
        if exc.status_code == 405:
            message = f"Method not allowed ({request.method} {request.url.path[:200]})"
            return respond(ApiError(405, message, code="method_not_allowed"))
        return respond(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(DataError)
    async def _unstorable(request: Request, exc: DataError) -> JSONResponse:
        # a value the database refuses (the checks before it should have caught it)
        log.warning("%s %s: the database refused a value (%s)", request.method,
                    request.url.path, type(exc.orig).__name__)
        return respond(ApiError(400, "The request holds a value that cannot be stored (a NUL "
                                "character, or text that is not UTF-8)",
                                code="invalid_value"))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # the client went away mid-body: nothing to answer, and no fault of the server's
        log.warning("%s %s: the client disconnected before its body ended", request.method,
                 request.url.path)
        return respond(ApiError(400, "The request body ended early (the client "
                                "disconnected)", code="client_disconnected"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return respond(ApiError(500, f"The server had an error while processing your request "
                                f"({type(exc).__name__})"))


class HeaderLimit:
    """ASGI middleware: a request whose headers exceed ``limit`` bytes is refused with 431
    in the OpenAI shape, before any route runs."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.limit:
                response = respond(ApiError(
                    431, f"Request headers are too large ({size} bytes; at most {self.limit})",
                    code="headers_too_large"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
