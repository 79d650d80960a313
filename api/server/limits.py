"""The gate: who is asking and how much they may send, settled before a route reads a byte.

An ASGI middleware in front of every /v1/ route. It checks the API key first, from the
headers alone (a request without a live key is answered 401 and its body is never read;
a key found live in the last few seconds is trusted without asking the database again:
auth.py, `Keys`),
then counts the body's bytes as they arrive, chunked bodies included, against the route's
cap: `JSON_BYTES` for every JSON route, the upload limit plus `FORM_BYTES` for
``POST /v1/files``. A body past its cap is answered 413 at once (a Content-Length past it
before any byte is read); the route sees its client gone and whatever it answers is
dropped. Memory stays bounded whatever is sent: uvicorn stops reading a connection whose
app does not take the bytes, and nothing here keeps them.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.concurrency import run_in_threadpool

from specq.api.server.auth import Keys, who_is
from specq.api.server.errors import ApiError, respond
from specq.configs.settings import Settings

log = logging.getLogger(__name__)

JSON_BYTES = 1 << 20  # a JSON request body (a batch create is a few hundred bytes)
FORM_BYTES = 1 << 20  # an upload's form fields, part headers and boundaries


def body_cap(settings: Settings, method: str, path: str) -> int:
    """The most bytes a request's body may have on this route."""
    if method == "POST" and path.rstrip("/") == "/v1/files":
        return settings.api_max_file_bytes + FORM_BYTES
    return JSON_BYTES


def too_large(cap: int) -> ApiError:
    return ApiError(413, f"The request body is larger than {cap} bytes (the limit for this "
                    "route)", code="request_too_large", headers={"connection": "close"})


class Gate:
    """ASGI middleware: the key checked before the body, and the body capped as it comes."""

    def __init__(self, app: Any, *, settings: Settings, client: Any) -> None:
        self.app, self.settings, self.client = app, settings, client
        self.keys = Keys()  # the live keys found lately: most requests need no thread hop

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization")
        header = None if auth is None else auth.decode("latin-1")
        try:
            who = self.keys.known(header) or await run_in_threadpool(
                who_is, self.client, header, self.keys)
        except ApiError as exc:
            await _answer(exc, scope, receive, send)
            return
        scope.setdefault("state", {})["caller"] = who
        cap = body_cap(self.settings, scope["method"], scope["path"])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > cap):
            await _answer(too_large(cap), scope, receive, send)
            return
        await self._capped(scope, receive, send, cap)

    async def _capped(self, scope: dict[str, Any], receive: Any, send: Any, cap: int) -> None:
        seen, refused, started = 0, False, False

        async def counted() -> dict[str, Any]:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    refused = True
                    log.info("%s %s: body past %d bytes, refused", scope["method"],
                             scope["path"], cap)
                    if not started:
                        await respond(too_large(cap))(scope, receive, send)
                    return {"type": "http.disconnect"}  # the route stops reading
            return message

        async def sending(message: dict[str, Any]) -> None:
            nonlocal started
            if refused:
                return  # the 413 was the answer
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except Exception:
            if not refused:
                raise  # (a route that failed for its cut-off body: the 413 said why)


async def _answer(exc: ApiError, scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A refusal sent before the body is read; a connection with a body coming closes
    after it (uvicorn does not read a body nobody takes)."""
    headers = dict(scope["headers"])
    if headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers:
        exc.headers = {**(exc.headers or {}), "connection": "close"}
    await respond(exc)(scope, receive, send)
