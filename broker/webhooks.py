"""The webhook sender: posts the outbox's due events (db/webhooks.py), signed, at least once.

One rule: a delivery is posted until a 2xx answer is recorded for it, and never after. A
sender claims due rows under a lease (several senders share the work; a killed one's rows
come back when its lease runs out), posts each with the Standard Webhooks headers, and
records the attempt in its own transaction as soon as the answer is in. A sender killed
between a 2xx and that record posts the event once more: the receiver keeps the
``webhook-id`` values it has seen (OpenAI's receivers do the same).

    webhook-id          the event's id (evt_...), the same on every attempt
    webhook-timestamp   seconds since the epoch, of this attempt
    webhook-signature   v1,<base64 HMAC-SHA256 of "id.timestamp.body" keyed by the
                        secret's bytes (base64 after whsec_)>

The request goes to an address the sender has just resolved and checked itself
(schema/addresses.py), never through a redirect, so a name re-pointed at a private address
after it was registered is refused at the post.

Run it as `specq webhooks send` (docker-compose.yml: the webhooks service).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import logging
import os
import socket
import ssl
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from specq.configs.settings import Settings
from specq.db import webhooks as outbox
from specq.db.session import session_factory
from specq.schema.addresses import Target, TargetError, parse_target, resolve

log = logging.getLogger(__name__)
MAX_ANSWER = 64 * 1024  # bytes of an answer read (and dropped) before the connection closes


def signature(secret: str, event_id: str, timestamp: int, body: str) -> str:
    """The webhook-signature header of a body sent at ``timestamp``."""
    key = base64.b64decode(secret.removeprefix(outbox.SECRET_PREFIX))
    mac = hmac.new(key, f"{event_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def headers(secret: str | tuple[str, ...], event_id: str, body: str,
            now: float | None = None) -> dict[str, str]:
    """The Standard Webhooks headers; with several secrets (one rotated out that still
    counts) one signature each, space-separated: a receiver accepts any that matches."""
    timestamp = int(time.time() if now is None else now)
    keys = (secret,) if isinstance(secret, str) else secret
    return {"content-type": "application/json", "user-agent": "specq-webhooks",
            "webhook-id": event_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(signature(k, event_id, timestamp, body)
                                          for k in keys)}


class _Pinned(http.client.HTTPConnection):
    """An HTTP connection to one checked address, the Host header the URL's."""

    def __init__(self, target: Target, address: str, timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedTLS(http.client.HTTPSConnection):
    """An HTTPS connection to one checked address; the certificate is checked against the
    URL's host name."""

    def __init__(self, target: Target, address: str, timeout: float) -> None:
        self.tls = ssl.create_default_context()
        super().__init__(target.host, target.port, timeout=timeout, context=self.tls)
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self.tls.wrap_socket(sock, server_hostname=self.host)


@dataclass(frozen=True)
class Answer:
    status_code: int | None  # None: no answer (refused, timed out, not allowed)
    error: str | None
    seconds: float


def post(url: str, body: str, head: dict[str, str], settings: Settings) -> Answer:
    """POST ``body`` to ``url`` once (no redirect followed); what came back, within
    ``webhook_timeout`` seconds in all: a receiver that trickles its headers or its answer
    (each byte within a socket's timeout) has its connection cut at the deadline, so a
    post never outlives its sender's lease. A status read before the cut stands."""
    t0 = time.monotonic()
    code: int | None = None
    cut = threading.Event()
    try:
        target = parse_target(url, allow_http=settings.webhook_allow_http)
        address = resolve(target, allow_private=settings.webhook_allow_private)[0]
        kind = _PinnedTLS if target.scheme == "https" else _Pinned
        conn = kind(target, address, settings.webhook_timeout)
        deadline = threading.Timer(settings.webhook_timeout, _cut, (conn, cut))
        deadline.start()
        try:
            conn.request("POST", target.path, body=body.encode(), headers=head)
            answer = conn.getresponse()
            if cut.is_set():  # headers cut short read as ended: no answer
                raise TimeoutError("cut at the deadline")
            code = answer.status
            answer.read(MAX_ANSWER)  # read and dropped: the status is what counts
        finally:
            deadline.cancel()
            conn.close()
    except TargetError as exc:
        return Answer(None, f"refused: {exc}", time.monotonic() - t0)
    except (OSError, http.client.HTTPException, ValueError) as exc:  # refused, reset, TLS
        if code is None:
            why = (f"no answer within {settings.webhook_timeout:g} s" if cut.is_set()
                   else f"{type(exc).__name__}: {exc}")
            return Answer(None, why[:500], time.monotonic() - t0)
    assert code is not None  # (set before any read that could fail past it)
    return Answer(code, None if 200 <= code < 300 else f"answered {code}",
                  time.monotonic() - t0)


def _cut(conn: http.client.HTTPConnection, cut: threading.Event) -> None:
    """The post's deadline: shut its socket, which ends the read waiting on it."""
    cut.set()
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already


class Sender:
    """Claims due deliveries and posts them, ``workers`` at a time."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session] | None = None,
                 workers: int = 8, batch: int = 64) -> None:
        self.settings = settings
        self.sessions = sessions or session_factory(settings.sqlalchemy_url)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.workers, self.batch = workers, batch
        # a lease outlasts a post: connect, send and answer each within the timeout
        self.hold = 3 * settings.webhook_timeout + 2

    def run_once(self) -> int:
        """Post what is due now (up to ``batch``); how many were posted."""
        with self.sessions.begin() as s:
            due = outbox.claim_due(s, owner=self.owner, hold=self.hold, limit=self.batch)
        if not due:
            return 0
        with ThreadPoolExecutor(min(self.workers, len(due))) as pool:
            list(pool.map(self._deliver, due))
        return len(due)

    def _deliver(self, due: outbox.Due) -> None:
        answer = post(due.url, due.body, headers(due.secrets, due.event_id, due.body),
                      self.settings)
        s = self.settings
        with self.sessions.begin() as session:
            status = outbox.record(session, delivery_id=due.id, owner=self.owner,
                                   status_code=answer.status_code, error=answer.error,
                                   seconds=answer.seconds, backoff=s.webhook_backoff,
                                   backoff_max=s.webhook_backoff_max,
                                   retry_for=s.webhook_retry_for)
        if status == outbox.GONE:
            log.info("webhook %s (delivery %d): deleted with its endpoint during the post",
                     due.event_id, due.id)
        elif status == outbox.FAILED:
            log.error("webhook %s (delivery %d): given up after %d attempts: %s",
                      due.event_id, due.id, due.attempts + 1, answer.error)
        elif answer.error is not None:
            log.info("webhook %s (delivery %d): attempt %d: %s; retried later", due.event_id,
                     due.id, due.attempts + 1, answer.error)

    def run(self, stop: threading.Event) -> None:
        """Post until ``stop`` is set; a database away is waited out."""
        log.info("webhook sender %s: started", self.owner)
        while not stop.is_set():
            try:
                if self.run_once():
                    continue
                with self.sessions() as s:
                    due_in = outbox.next_due_in(s)
            except Exception as exc:  # the database away, or a bug: log, try again later
                log.warning("webhook sender: %s: %s", type(exc).__name__,
                            (str(exc).splitlines() or [""])[0])
                due_in = None
            wait = self.settings.webhook_poll if due_in is None else \
                min(due_in, self.settings.webhook_poll)
            stop.wait(max(wait, 0.01))
