"""Webhooks over HTTP, through the official `openai` SDK against `specq serve` (a subprocess
on PostgreSQL): a tenant manages its endpoints (client.webhooks), a private address is
refused, and a batch cancelled over HTTP reaches a real receiver as batch.cancelled, which
the SDK's webhooks.unwrap verifies and parses."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from specq.api.client import Client
from specq.broker.webhooks import Sender
from specq.db import webhooks
from tests.conftest import wait_until
from tests.pipeline.conftest import own_deployment
from tests.pipeline.test_http import CHAT, Server, line, new_key, upload


@pytest.fixture(scope="module")
def hook_settings(settings, tmp_path_factory):
    return own_deployment(settings, "hooks", api_files_dir=tmp_path_factory.mktemp("files"),
                          webhook_allow_http=True, webhook_backoff=0.05,
                          webhook_backoff_max=0.2, webhook_timeout=2.0, webhook_poll=0.05)


@pytest.fixture(scope="module")
def server(hook_settings, tmp_path_factory):
    s = Server(hook_settings, tmp_path_factory.mktemp("server") / "serve.log")
    s.start()
    yield s
    s.stop()


def test_a_tenant_manages_its_endpoints_and_a_private_url_is_refused(server, hook_settings):
    sdk = openai.OpenAI(base_url=server.url, api_key=new_key(hook_settings), max_retries=0)
    other = openai.OpenAI(base_url=server.url, api_key=new_key(hook_settings), max_retries=0)
    made = sdk.webhooks.create(name="ops", url="https://93.184.216.34/hooks",
                               event_types=["batch.completed", "batch.failed"])
    assert made.signing_secret.startswith("whsec_") and made.object == "webhook_endpoint"
    assert made.event_types == ["batch.completed", "batch.failed"]
    got = sdk.webhooks.retrieve(made.id)
    assert got.url == made.url and made.signing_secret not in got.model_dump_json()
    assert [e.id for e in sdk.webhooks.list()] == [made.id]
    assert list(other.webhooks.list()) == []
    with pytest.raises(openai.NotFoundError):
        other.webhooks.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        other.webhooks.delete(made.id)
    for url in ("http://127.0.0.1:8080/h", "http://169.254.169.254/latest",
                "http://localhost/h"):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.webhooks.create(name="x", url=url, event_types=["batch.completed"])
        assert refused.value.body["param"] == "url" and "SPECQ_WEBHOOK_ALLOW_PRIVATE" in \
            refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.webhooks.create(name="x", url="https://93.184.216.34/", event_types=["job.done"])
    assert refused.value.body["param"] == "event_types"
    changed = sdk.webhooks.update(made.id, name="renamed", url="https://93.184.216.35/h")
    assert (changed.name, changed.url, changed.event_types) == (
        "renamed", "https://93.184.216.35/h", ["batch.completed", "batch.failed"])
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.webhooks.update(made.id, url="https://10.0.0.1/h")
    assert refused.value.body["param"] == "url"
    with pytest.raises(openai.NotFoundError):
        other.webhooks.update(made.id, name="theirs")
    rotated = sdk.webhooks.rotate_secret(made.id, keep_old_secret_active_for_24_hours=True)
    assert rotated.signing_secret.startswith("whsec_")
    assert rotated.signing_secret != made.signing_secret
    assert sdk.webhooks.retrieve(made.id).signing_secret_hint == \
        rotated.signing_secret[:10] + "..."
    with pytest.raises(openai.NotFoundError):
        other.webhooks.rotate_secret(made.id)
    for call in (sdk.webhooks.retrieve, sdk.webhooks.delete,
                 lambda i: sdk.webhooks.list(after=i)):
        with pytest.raises(openai.NotFoundError):  # no id of ours: a 404, as any unknown one
            call("we_\x00nul")
    deleted = sdk.webhooks.delete(made.id)
    assert deleted.deleted and deleted.id == made.id
    assert list(sdk.webhooks.list()) == []


def test_a_batch_cancelled_over_http_reaches_the_receiver_signed(server, hook_settings):
    received: list[tuple[bytes, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            received.append((self.rfile.read(int(self.headers["content-length"])),
                             dict(self.headers)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    key = new_key(hook_settings, "hooked-tenant")
    sdk = openai.OpenAI(base_url=server.url, api_key=key, max_retries=0)
    client = Client(hook_settings)
    with client.sessions.begin() as s:  # the operator registers a local receiver
        tid = webhooks.tenant_id_of(s, tenant="hooked-tenant")
        _, secret = webhooks.add_endpoint(
            s, url=f"http://127.0.0.1:{receiver.server_address[1]}/in", tenant_id=tid,
            allow_private=True, allow_http=True)
    stop = threading.Event()
    sender = threading.Thread(target=Sender(hook_settings.model_copy(
        update={"webhook_allow_private": True})).run, args=(stop,))
    sender.start()
    try:
        f = upload(sdk, [line(f"r{i}", f"hello {i}") for i in range(3)])
        batch = sdk.batches.create(input_file_id=f.id, endpoint=CHAT,
                                   completion_window="24h", metadata={"run": "nightly"})
        wait_until(lambda: sdk.batches.retrieve(batch.id).status == "in_progress", 60,
                   "the batch in progress")
        sdk.batches.cancel(batch.id)  # no worker runs it: its job ends cancelled at once
        wait_until(lambda: received, 30, "the batch.cancelled event at the receiver")
        body, head = received[0]
        event = openai.OpenAI(api_key="unused", webhook_secret=secret).webhooks.unwrap(
            body, head)
        assert type(event).__name__ == "BatchCancelledWebhookEvent"
        assert event.data.id == batch.id and event.id == head["webhook-id"]
        extra = event.data.model_dump()
        assert extra["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
        assert extra["metadata"] == {"run": "nightly"}
    finally:
        stop.set()
        sender.join(10)
        receiver.shutdown()
        receiver.server_close()


def test_an_upload_carries_expires_after_as_openai_documents_it(server, hook_settings):
    sdk = openai.OpenAI(base_url=server.url, api_key=new_key(hook_settings), max_retries=0)
    data = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    f = sdk.files.create(file=("x.jsonl", data), purpose="batch",
                         expires_after={"anchor": "created_at", "seconds": 7200})
    assert f.expires_at == f.created_at + 7200
    assert sdk.files.retrieve(f.id).expires_at == f.expires_at
    assert upload(sdk, [line("b", "hi")]).expires_at is None  # no retention set: kept
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.files.create(file=("x.jsonl", data), purpose="batch",
                         expires_after={"anchor": "created_at", "seconds": 5})
    assert refused.value.body["param"] == "expires_after"
    assert "expires_after.seconds" in refused.value.body["message"]
