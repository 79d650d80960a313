"""Who is calling: the tenant of the request's API key (db/tenants.py)."""

from __future__ import annotations

from fastapi import Request

from specq.api.server.errors import ApiError
from specq.db import tenants
from specq.db.tenants import Caller


def caller(request: Request) -> Caller:
    """The tenant of the request's key: 401 for a missing, unknown or revoked key. The key
    is never logged nor repeated in a message."""
    header = request.headers.get("authorization")
    if not header:
        raise ApiError(401, "You didn't provide an API key. Send it in the Authorization "
                       "header: 'Authorization: Bearer KEY' (`specq keys create NAME` "
                       "makes one).", code="missing_api_key")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "The Authorization header must read 'Bearer KEY'.",
                       code="invalid_api_key")
    with request.app.state.client.sessions() as s:
        who = tenants.authenticate(s, key=key.strip())
    if who is None:
        raise ApiError(401, "Incorrect API key provided: it is unknown or was revoked.",
                       code="invalid_api_key")
    return who
