"""Who is calling: the tenant of the request's API key (db/tenants.py).

The key is checked by the gate (api/server/limits.py) before a byte of the body is read;
routes take the caller it found (`caller`)."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from specq.api.server.errors import ApiError
from specq.db import tenants
from specq.db.tenants import Caller


def who_is(client: Any, header: str | None) -> Caller:
    """The tenant of an Authorization header: 401 for a missing, unknown or revoked key.
    The key is never logged nor repeated in a message."""
    if not header:
        raise ApiError(401, "You didn't provide an API key. Send it in the Authorization "
                       "header: 'Authorization: Bearer KEY' (`specq keys create NAME` "
                       "makes one).", code="missing_api_key")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise ApiError(401, "The Authorization header must read 'Bearer KEY'.",
                       code="invalid_api_key")
    who = None
    if key.isascii() and key.isprintable() and len(key) <= 256:  # no key is otherwise
        with client.sessions() as s:
            who = tenants.authenticate(s, key=key)
    if who is None:
        raise ApiError(401, "Incorrect API key provided: it is unknown or was revoked.",
                       code="invalid_api_key")
    return who


def caller(request: Request) -> Caller:
    """The caller the gate found (or, without the gate, the key's tenant now)."""
    found = request.scope.get("state", {}).get("caller")
    if isinstance(found, Caller):
        return found
    return who_is(request.app.state.client, request.headers.get("authorization"))
