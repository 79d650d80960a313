"""The connection guard: uvicorn's h11 protocol with the deadlines a server facing clients
it does not trust needs, which uvicorn itself does not keep.

uvicorn closes a connection idle *between* requests (``timeout_keep_alive``), but a client
that never finishes a request's headers, or stops sending a body it announced, holds its
connection (and a file descriptor) for ever: a few thousand such connections from one
client (slowloris) use up the process's descriptors, and no one else is served. So:

- a request's head (request line and headers) must arrive within ``api_header_timeout``
  seconds of its first byte, or of the connection's opening, however it trickles in;
- a body must not pause longer than ``api_body_timeout`` seconds between two arrivals
  (while the server itself is not the one holding it back: a paused read is not counted);
- one client address holds at most ``api_max_client_connections`` connections; a
  connection past it is closed as it opens.

A connection that breaks a rule is closed; a request it was sending sees its client gone,
as with a client that hangs up. What was refused is logged at most once every few seconds
with a count, so a flood cannot fill the log either. nginx keeps the same two deadlines
(client_header_timeout, client_body_timeout); behind such a proxy, every connection comes
from the proxy's address: set ``api_max_client_connections`` to 0 there (no cap) and let
the proxy keep its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specq.configs.settings import get_settings

log = logging.getLogger(__name__)
NOTE_EVERY = 10.0  # seconds between two log lines about refused connections


class _Notes:
    """Counts refusals by reason and logs them at most once every NOTE_EVERY seconds."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.last = 0.0

    def add(self, reason: str) -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        if now - self.last >= NOTE_EVERY:
            self.last = now
            log.warning("connections closed: %s", ", ".join(
                f"{n} {why}" for why, n in sorted(self.counts.items())))
            self.counts.clear()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and the per-client cap above."""

    per_client: Counter[str] = Counter()  # open connections by client address, this process
    notes = _Notes()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self.head_timeout = settings.api_header_timeout
        self.body_timeout = settings.api_body_timeout
        self.max_per_client = settings.api_max_client_connections
        self._guard: asyncio.TimerHandle | None = None
        self._guarding: str | None = None  # "head" or "body": what the timer waits for
        self._host: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._host = self.client[0] if self.client else None
        if self._host is not None:
            self.per_client[self._host] += 1
            if self.max_per_client and self.per_client[self._host] > self.max_per_client:
                self.notes.add("past a client's connection cap "
                               "(SPECQ_API_MAX_CLIENT_CONNECTIONS)")
                transport.close()
                return
        self._arm("head", self.head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._host is not None:
            self.per_client[self._host] -= 1
            if self.per_client[self._host] <= 0:
                del self.per_client[self._host]
            self._host = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # a request's head is arriving: one deadline for all of it
            if self._guarding != "head":
                self._arm("head", self.head_timeout)
        elif state is h11.SEND_BODY:  # its body: a deadline for the next arrival
            self._arm("body", self.body_timeout)
        else:  # the request is in: the server's turn (keep-alive covers what follows)
            self._disarm()

    def on_response_complete(self) -> None:
        self._disarm()  # uvicorn's keep-alive timer watches the idle connection now
        super().on_response_complete()

    def _arm(self, what: str, seconds: float) -> None:
        self._disarm()
        self._guarding = what
        self._guard = self.loop.call_later(seconds, self._expired, what)

    def _disarm(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
        self._guard, self._guarding = None, None

    def _expired(self, what: str) -> None:
        self._guard, self._guarding = None, None
        if self.transport.is_closing():
            return
        if what == "body" and (self.flow.read_paused
                               or self.conn.they_are_waiting_for_100_continue):
            self._arm("body", self.body_timeout)  # the server holds the body back (a paused
            return  # read, a 100 Continue not yet sent), not the client
        self.notes.add("a request's head not sent within SPECQ_API_HEADER_TIMEOUT"
                       if what == "head" else
                       "a body paused past SPECQ_API_BODY_TIMEOUT")
        self.transport.close()
