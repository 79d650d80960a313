"""The webhook sender (broker/webhooks.py) against a real HTTP receiver on 127.0.0.1 and a
fresh PostgreSQL database: a receiver that is down, then up, gets every event once; a
sender killed -9 mid-post loses none; failures are retried with back-off, every attempt
recorded, and given up after webhook_retry_for. Back-offs are fractions of a second."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sqlalchemy import func, select

from specq.broker.webhooks import Sender
from specq.configs.settings import Settings
from specq.db import repository as repo
from specq.db import webhooks
from specq.db.models import WebhookAttempt, WebhookDelivery
from specq.db.session import migrate, session_factory

from ..conftest import fresh_pg_database, wait_until

ROOT = Path(__file__).resolve().parents[2]


class Receiver:
    """A webhook receiver: keeps each request's id, verified with the endpoint's secret by
    the openai SDK, and answers ``code`` (``hold``: each request waits until released)."""

    def __init__(self, port: int = 0, secret: str | None = None) -> None:
        import openai

        self.sdk = openai.OpenAI(api_key="unused")
        self.secret = secret
        self.ids: list[str] = []
        self.code = 200
        self.hold = threading.Event()
        self.hold.set()
        self.arrived = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                if outer.secret is not None:
                    outer.sdk.webhooks.verify_signature(body, dict(self.headers),
                                                        secret=outer.secret)
                outer.arrived.set()
                outer.hold.wait(30)
                outer.ids.append(self.headers["webhook-id"])
                self.send_response(outer.code)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with fresh_pg_database() as url:
        migrate(url)
        yield url


def settings_for(url: str, **over) -> Settings:
    return Settings(**{"database_url": url, "webhook_allow_private": True,
                       "webhook_allow_http": True, "webhook_backoff": 0.05,
                       "webhook_backoff_max": 0.2, "webhook_timeout": 0.5,
                       "webhook_poll": 0.05, **over})


def ended_jobs(sessions, n: int) -> list[int]:
    """``n`` jobs cancelled before they ran (each ends at once: one job.cancelled event)."""
    ids = []
    for _ in range(n):
        with sessions.begin() as s:
            job = repo.create_job(s, pair="tiny", params={}, chunk_size=4, source=None)
            ids.append(job.id)
        with sessions.begin() as s:
            repo.request_cancel(s, job_id=job.id)
    return ids


def endpoint(sessions, port: int) -> tuple[str, str]:
    with sessions.begin() as s:
        # the endpoints of earlier tests go: this test's events are the only ones due
        for e in webhooks.list_endpoints(s)[0]:
            webhooks.remove_endpoint(s, openai_id=e.id)
        info, secret = webhooks.add_endpoint(s, url=f"http://127.0.0.1:{port}/hook",
                                             tenant_id=None, allow_private=True,
                                             allow_http=True)
    return info.id, secret


def deliveries(sessions, endpoint_id: str) -> dict[str, str]:
    with sessions() as s:
        eid = s.scalar(select(webhooks.WebhookEndpoint.id)
                       .where(webhooks.WebhookEndpoint.openai_id == endpoint_id))
        return dict(s.execute(select(WebhookDelivery.event_id, WebhookDelivery.status)
                              .where(WebhookDelivery.endpoint_id == eid)).all())


def test_a_receiver_down_then_up_gets_every_event_once(url):
    sessions = session_factory(url)
    port = free_port()  # nobody listens there yet
    ep, secret = endpoint(sessions, port)
    ended_jobs(sessions, 6)
    events = deliveries(sessions, ep)
    assert len(events) == 6 and set(events.values()) == {"pending"}
    stop = threading.Event()
    # delivery is at least once: a post answered after webhook_timeout is posted again (a
    # receiver dedupes by id). Refusals are this test's subject, and they come at once; a
    # busy machine's receiver may take more than half a second to answer, so it gets 5 s
    patient = settings_for(url, webhook_timeout=5.0)
    sender = threading.Thread(target=Sender(patient).run, args=(stop,))
    sender.start()
    receiver = None
    try:
        def refused_twice() -> bool:
            with sessions() as s:
                return s.scalar(select(func.min(WebhookDelivery.attempts))
                                .where(WebhookDelivery.event_id.in_(list(events)))) >= 2
        wait_until(refused_twice, 30, "every event tried twice while the receiver is down")
        receiver = Receiver(port, secret)
        wait_until(lambda: set(deliveries(sessions, ep).values()) == {"delivered"}, 30,
                   "every event delivered once the receiver is up")
        assert Counter(receiver.ids) == Counter(dict.fromkeys(events, 1))
        with sessions() as s:  # every attempt recorded: the refused ones, then one 2xx each
            attempts = s.execute(
                select(WebhookDelivery.event_id, WebhookAttempt.status_code,
                       WebhookAttempt.error)
                .join(WebhookDelivery, WebhookDelivery.id == WebhookAttempt.delivery_id)
                .where(WebhookDelivery.event_id.in_(list(events)))).all()
        assert Counter(e for e, code, _ in attempts if code == 200) == Counter(
            dict.fromkeys(events, 1))
        assert all("Connection" in err for _, code, err in attempts if code is None)
        stop.set()
        sender.join(10)
        Sender(patient).run_once()  # nothing is due: nothing is posted again
        assert len(receiver.ids) == len(events)
    finally:
        stop.set()
        sender.join(10)
        if receiver is not None:
            receiver.close()


def test_a_receiver_that_keeps_failing_is_retried_with_backoff_then_given_up(url):
    sessions = session_factory(url)
    receiver = Receiver()
    receiver.code = 503
    ep, receiver.secret = endpoint(sessions, receiver.port)
    ended_jobs(sessions, 1)
    stop = threading.Event()
    # a busy machine's receiver (a thread of this process) may take more than half a second
    # to answer: the error would then be the timeout's, not the 503
    patient = settings_for(url, webhook_retry_for=3.0, webhook_timeout=5.0)
    sender = threading.Thread(target=Sender(patient).run, args=(stop,))
    sender.start()
    try:
        wait_until(lambda: set(deliveries(sessions, ep).values()) == {"failed"}, 30,
                   "the event given up after webhook_retry_for")
        with sessions() as s:
            times = list(s.scalars(select(WebhookAttempt.at).join(
                WebhookDelivery, WebhookDelivery.id == WebhookAttempt.delivery_id)
                .where(WebhookDelivery.event_id.in_(list(deliveries(sessions, ep))))
                .order_by(WebhookAttempt.id)))
            error = s.scalar(select(WebhookDelivery.last_error)
                             .where(WebhookDelivery.event_id.in_(
                                 list(deliveries(sessions, ep)))))
        assert len(times) == len(receiver.ids) >= 3 and error == "answered 503"
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert gaps[0] >= 0.05 and all(g >= 0.2 for g in gaps[2:])  # 0.05, 0.1, 0.2, 0.2...
    finally:
        stop.set()
        sender.join(10)
        receiver.close()


def test_a_sender_killed_mid_post_loses_no_event(url, tmp_path):
    sessions = session_factory(url)
    receiver = Receiver()
    ep, secret = endpoint(sessions, receiver.port)
    receiver.secret = secret
    ended_jobs(sessions, 12)
    events = deliveries(sessions, ep)
    receiver.hold.clear()  # the first posts wait, unanswered, until the sender is dead
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "SPECQ_DATABASE_URL": url,
           "SPECQ_WEBHOOK_ALLOW_PRIVATE": "1", "SPECQ_WEBHOOK_ALLOW_HTTP": "1",
           "SPECQ_WEBHOOK_TIMEOUT": "0.5", "SPECQ_WEBHOOK_BACKOFF": "0.05",
           "SPECQ_WEBHOOK_BACKOFF_MAX": "0.2", "SPECQ_WEBHOOK_POLL": "0.05",
           "SPECQ_DATA_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "specq.api.cli", "webhooks", "send"]
    # the first sender's posts outlast the kill: its leases (3 x 2 + 2 s) hold them till then
    first = subprocess.Popen(cmd, env={**env, "SPECQ_WEBHOOK_TIMEOUT": "2"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    second = None
    try:
        assert receiver.arrived.wait(60), "the sender never posted"
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        with sessions() as s:  # the posts it made are still its, leased, undelivered
            leased = s.scalar(select(func.count()).select_from(WebhookDelivery)
                              .where(WebhookDelivery.event_id.in_(list(events)),
                                     WebhookDelivery.lease_owner.is_not(None)))
        assert leased >= 1 and set(deliveries(sessions, ep).values()) == {"pending"}
        receiver.hold.set()
        second = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)
        wait_until(lambda: set(deliveries(sessions, ep).values()) == {"delivered"}, 60,
                   "every event delivered by the second sender once the leases ran out")
        assert set(receiver.ids) == set(events)  # none lost; the killed posts came again
        with sessions() as s:
            twice = s.scalar(select(func.count()).select_from(WebhookAttempt)
                             .join(WebhookDelivery,
                                   WebhookDelivery.id == WebhookAttempt.delivery_id)
                             .where(WebhookDelivery.event_id.in_(list(events)),
                                    WebhookAttempt.status_code == 200))
        assert twice == len(events)  # one recorded 2xx each: none posted after its 2xx
        second.send_signal(signal.SIGTERM)
        assert second.wait(20) == 0, second.stderr.read().decode() if second.stderr else ""
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        receiver.close()


def test_the_sender_checks_the_address_again_before_each_post(url):
    """An endpoint registered while private addresses were allowed (or a name that now
    resolves to one): a sender that does not allow them refuses to post, records why."""
    sessions = session_factory(url)
    receiver = Receiver()
    ep, _ = endpoint(sessions, receiver.port)
    ended_jobs(sessions, 1)
    strict = settings_for(url).model_copy(update={"webhook_allow_private": False})
    try:
        assert Sender(strict).run_once() == 1
        with sessions() as s:
            error = s.scalar(select(WebhookDelivery.last_error).where(
                WebhookDelivery.event_id.in_(list(deliveries(sessions, ep)))))
        assert error.startswith("refused: url: host '127.0.0.1' is a loopback") and \
            "SPECQ_WEBHOOK_ALLOW_PRIVATE" in error
        assert receiver.ids == [] and set(deliveries(sessions, ep).values()) == {"pending"}
    finally:
        receiver.close()


class Trickler:
    """A receiver that answers a byte at a time, each within a socket's timeout: its
    headers (``headers=True``), or a 200 then its body, for as long as it is let."""

    def __init__(self, headers: bool) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.headers, self.stop = headers, threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n" if self.headers else
                         b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n")
            n = 0
            while not self.stop.wait(0.5):  # within the socket's 1 s timeout
                try:
                    conn.sendall(f"x-trickle-{n}: 1\r\n".encode() if self.headers else b"x")
                except OSError:
                    return
                n += 1

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("headers", [True, False], ids=["headers", "body"])
def test_a_post_ends_at_its_timeout_however_the_receiver_trickles(headers):
    """webhook_timeout bounds the whole post (a socket's timeout alone bounds each read): a
    receiver trickling its headers is no answer, one that said 200 and trickles its body
    was answered; either way the post ends within the timeout, not the receiver's pace."""
    from specq.broker.webhooks import post

    receiver = Trickler(headers)
    try:
        got = post(f"http://127.0.0.1:{receiver.port}/hook", "{}", {},
                   settings_for("sqlite://", webhook_timeout=1.0))
    finally:
        receiver.close()
    # (a socket timeout alone: 100 header lines, 50 s, or 100 kB of body, 14 h; the margin
    # is for a busy machine)
    assert got.seconds < 10.0, got
    if headers:
        assert got.status_code is None and got.error == "no answer within 1 s", got
    else:
        assert (got.status_code, got.error) == (200, None), got


def test_two_senders_on_sqlite_claim_each_delivery_once(tmp_path):
    """SQLite takes no row lock for the claim's select: two senders that read the same due
    rows must not both take them (the lease is tested again in the claim's write), and a
    sender whose lease was taken over leaves the row to the one that holds it."""
    url = f"sqlite:///{tmp_path / 'w.db'}"
    migrate(url)
    sessions = session_factory(url)
    with sessions.begin() as s:
        webhooks.add_endpoint(s, url="http://127.0.0.1:9/hook", tenant_id=None,
                              allow_private=True, allow_http=True)
    ended_jobs(sessions, 3)
    first, second = sessions(), sessions()
    try:
        first.begin()
        second.begin()
        seen_first = [d.id for d in webhooks.claim_due(first, owner="a", hold=60, limit=10)]
        first.commit()
        seen_second = webhooks.claim_due(second, owner="b", hold=60, limit=10)
        second.commit()
    finally:
        first.close()
        second.close()
    assert len(seen_first) == 3 and seen_second == []
    with sessions.begin() as s:  # "b" answers for a row it does not hold: kept, not applied
        status = webhooks.record(s, delivery_id=seen_first[0], owner="b", status_code=500,
                                 error="late", seconds=9.0, backoff=1, backoff_max=1,
                                 retry_for=0.0)
    assert status == "pending"
    with sessions() as s:
        row = s.get(WebhookDelivery, seen_first[0])
        assert (row.lease_owner, row.attempts, row.status) == ("a", 0, "pending")
        assert s.scalar(select(func.count()).select_from(WebhookAttempt)) == 1
