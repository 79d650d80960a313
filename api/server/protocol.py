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
as with a client that hangs up.

An answer given while the client is still sending its body (a 413 for a body past its
route's cap, a 401 before an upload is read) closes the connection with that body still
arriving. Closed at once, the kernel answers the bytes still coming with a reset, and a
client that sends before it reads (curl, after ``Expect: 100-continue`` went unanswered)
loses the answer with it: "connection reset" where the server said 413. Such a connection
is closed as nginx does (lingering close): the answer goes out with the server's half of
the connection shut, what the client still sends is read and dropped, and the connection
closes when the client closes its half, or after ``LINGER`` seconds.

What was refused is logged at most once every few seconds with a count, so a flood cannot
fill the log either. nginx keeps the same two deadlines (client_header_timeout,
client_body_timeout); behind such a proxy, every connection comes from the proxy's
address: set ``api_max_client_connections`` to 0 there (no cap) and let the proxy keep its
own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specq.configs.settings import get_settings

log = logging.getLogger(__name__)
NOTE_EVERY = 10.0  # seconds between two log lines about refused connections
LINGER = 5.0  # seconds an answered connection reads (and drops) a body still arriving


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
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        # uvicorn closes through self.transport (its request cycles take it from here)
        self.transport = cast(asyncio.Transport, _Lingering(transport, self))
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
        if self._lingering:
            return  # the rest of a body the answer came before: dropped
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

    def linger(self, transport: asyncio.Transport) -> bool:
        """Close ``transport`` by lingering if the client is still sending a request's
        body; False where a plain close is right: nothing is arriving, the half-close
        cannot be done, or this is a second close (a shutting-down server's)."""
        if (self._lingering or self.conn.their_state is not h11.SEND_BODY
                or transport.is_closing() or not transport.can_write_eof()):
            return False
        self._disarm()
        self._lingering = True
        transport.write_eof()  # the answer, then the server's FIN
        self.flow.resume_reading()
        self._guard = self.loop.call_later(LINGER, transport.close)
        return True

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
        self._raw.close()  # cut, not lingered: the client is the one holding it


class _Lingering:
    """The connection's transport as uvicorn sees it: a close while the client is still
    sending becomes a lingering close (GuardedH11Protocol.linger); all else is the
    transport's own. Reads as closing once lingering, so uvicorn neither arms its
    keep-alive timer nor starts another request on it."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self._transport, self._protocol = transport, protocol

    def close(self) -> None:
        if not self._protocol.linger(self._transport):
            self._transport.close()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
