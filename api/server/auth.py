"""Who is calling: the tenant of the request's API key (db/tenants.py).

The key is checked by the gate (api/server/limits.py) before a byte of the body is read;
routes take the caller it found (`caller`). A server remembers the live keys it found for
KEY_TTL seconds (`Keys`), so a client polling a batch costs no database round trip for
its key; a key revoked (`specq keys revoke`) is refused by every server within KEY_TTL.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import Request

from specq.api.server.errors import ApiError
from specq.db import tenants
from specq.db.tenants import Caller

KEY_TTL = 2.0  # seconds a server trusts a key it found live (a revocation's delay at most)
KEYS_KEPT = 10_000  # live keys remembered at most; past it, all are forgotten at once


class Keys:
    """The live keys a server checked in the last KEY_TTL seconds, by their SHA-256 (the
    key itself is not kept). Only live keys are remembered: an unknown or revoked key is
    looked up every time, as before."""

    def __init__(self, ttl: float = KEY_TTL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._seen: dict[str, tuple[float, Caller]] = {}

    def get(self, digest: str) -> Caller | None:
        seen = self._seen.get(digest)
        if seen is None or self.clock() - seen[0] > self.ttl:
            return None
        return seen[1]

    def put(self, digest: str, who: Caller) -> None:
        if len(self._seen) >= KEYS_KEPT:
            self._seen.clear()
        self._seen[digest] = (self.clock(), who)

    def known(self, header: str | None) -> Caller | None:
        """The caller of this Authorization header if its key was found live within the
        last ``ttl`` seconds; None otherwise (then `who_is` decides). No I/O: the gate
        asks it on the event loop."""
        try:
            key = bearer(header)
        except ApiError:
            return None
        return self.get(tenants.key_hash(key))


def bearer(header: str | None) -> str:
    """The key of an Authorization header; a 401 if it is missing or not 'Bearer KEY'."""
    if not header:
        raise ApiError(401, "You didn't provide an API key. Send it in the Authorization "
                       "header: 'Authorization: Bearer KEY' (`specq keys create NAME` "
                       "makes one).", code="missing_api_key")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise ApiError(401, "The Authorization header must read 'Bearer KEY'.",
                       code="invalid_api_key")
    return key


def who_is(client: Any, header: str | None, keys: Keys | None = None) -> Caller:
    """The tenant of an Authorization header: 401 for a missing, unknown or revoked key
    (``keys``: the live keys found lately, asked first and told of a live one). The key is
    never logged nor repeated in a message."""
    key = bearer(header)
    who = None
    if key.isascii() and key.isprintable() and len(key) <= 256:  # no key is otherwise
        digest = tenants.key_hash(key)
        who = keys.get(digest) if keys is not None else None
        if who is None:
            with client.sessions() as s:
                who = tenants.authenticate(s, key=key)
            if who is not None and keys is not None:
                keys.put(digest, who)
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
