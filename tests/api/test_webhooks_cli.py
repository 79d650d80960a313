"""`specq webhooks add|list|remove|send` and `specq sweep` as an operator meets them, on a
SQLite database: the secret printed once, refusals that name the field and the setting,
list output without secrets."""

from __future__ import annotations

import json
import os

import pytest
from sqlalchemy import select

from specq.api import cli
from specq.api.client import Client
from specq.configs.settings import get_settings
from specq.db import tenants
from specq.db.models import WebhookDelivery
from specq.db.session import migrate


@pytest.fixture
def env(monkeypatch, tmp_path, data_dir):
    for key in list(os.environ):
        if key.startswith("SPECQ_"):
            monkeypatch.delenv(key)
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    migrate(url)
    for k, v in {"SPECQ_DATA_DIR": str(data_dir), "SPECQ_DATABASE_URL": url,
                 "SPECQ_BROKER_URL": "redis://127.0.0.1:1/0", "SPECQ_BROKER_TIMEOUT": "0.2",
                 "SPECQ_WEBHOOK_TIMEOUT": "1"}.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    get_settings.cache_clear()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_add_list_remove_and_refusals(env, capsys):
    code, _, err = run(["webhooks", "add", "http://127.0.0.1:9/h"], capsys)
    assert code == 2 and "https" in err and "SPECQ_WEBHOOK_ALLOW_HTTP" in err
    code, _, err = run(["webhooks", "add", "https://127.0.0.1:9/h"], capsys)
    assert code == 2 and "SPECQ_WEBHOOK_ALLOW_PRIVATE" in err
    env.setenv("SPECQ_WEBHOOK_ALLOW_PRIVATE", "true")
    env.setenv("SPECQ_WEBHOOK_ALLOW_HTTP", "true")
    code, out, err = run(["webhooks", "add", "http://127.0.0.1:9/ops", "--name", "ops",
                          "--event", "job.failed"], capsys)
    secret = out.strip().splitlines()[-1]
    assert code == 0 and secret.startswith("whsec_") and "the operator" in err
    code, _, err = run(["webhooks", "add", "http://127.0.0.1:9/t", "--tenant", "acme"], capsys)
    assert code == 1 and "tenant 'acme': not found" in err
    with Client().sessions.begin() as s:
        tenants.create_key(s, tenant="acme")
    code, _, err = run(["webhooks", "add", "http://127.0.0.1:9/t", "--tenant", "acme",
                        "--event", "job.failed"], capsys)
    assert code == 2 and "event_types: 'job.failed'" in err
    code, out, _ = run(["webhooks", "add", "http://127.0.0.1:9/t", "--tenant", "acme"], capsys)
    assert code == 0
    code, out, _ = run(["webhooks", "list", "--json"], capsys)
    listed = json.loads(out)
    assert secret not in out and [e["tenant"] for e in listed] == [None, "acme"]
    assert listed[0]["event_types"] == ["job.failed"] and listed[0]["secret"].endswith("...")
    assert listed[1]["event_types"] == ["batch.completed", "batch.failed", "batch.expired",
                                        "batch.cancelled"]
    code, out, _ = run(["webhooks", "list"], capsys)
    assert code == 0 and "(operator)" in out and "acme" in out and secret not in out
    assert run(["webhooks", "remove", listed[1]["id"]], capsys)[0] == 0
    code, _, err = run(["webhooks", "remove", listed[1]["id"]], capsys)
    assert code == 1 and "not found" in err


def test_send_once_posts_what_is_due_and_sweep_reports_json(env, capsys):
    env.setenv("SPECQ_WEBHOOK_ALLOW_PRIVATE", "true")
    env.setenv("SPECQ_WEBHOOK_ALLOW_HTTP", "true")
    assert run(["webhooks", "add", "http://127.0.0.1:9/nobody-listens"], capsys)[0] == 0
    get_settings.cache_clear()
    Client().submit(["x"], pair="tiny", enqueue=False).cancel()  # job.cancelled, pending
    code, _, err = run(["webhooks", "send", "--once"], capsys)
    assert code == 0 and "1 webhook deliveries posted" in err
    with Client().sessions() as s:
        status, attempts, error = s.execute(select(
            WebhookDelivery.status, WebhookDelivery.attempts, WebhookDelivery.last_error)).one()
    assert (status, attempts) == ("pending", 1) and "refused" in error.lower()
    code, out, _ = run(["sweep"], capsys)
    assert code == 0 and json.loads(out) == {
        "files": 0, "file_bytes": 0, "outputs": 0, "jobs_emptied": 0, "items_emptied": 0,
        "jobs_deleted": 0, "items_deleted": 0, "deliveries": 0}  # (the pending one stays)


def test_a_job_run_to_its_end_is_announced_to_the_operator(env, capsys):
    """The worker's own code settles the job (run_inline, the embedded mode): its
    job.completed event, with the counts, reaches a real receiver through `send --once`."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import openai

    from specq.configs.presets import get_preset
    from specq.worker.pairs import load_pair
    from specq.worker.tasks import run_inline

    got: list[tuple[bytes, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            got.append((self.rfile.read(int(self.headers["content-length"])),
                        dict(self.headers)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        env.setenv("SPECQ_WEBHOOK_ALLOW_PRIVATE", "true")
        env.setenv("SPECQ_WEBHOOK_ALLOW_HTTP", "true")
        code, out, _ = run(["webhooks", "add", "--event", "job.completed",
                            f"http://127.0.0.1:{receiver.server_address[1]}/jobs"], capsys)
        secret = out.strip().splitlines()[-1]
        client = Client()
        engine = load_pair(get_preset("tiny", client.settings.presets_file),
                           client.settings).engine()
        job = client.submit(["Say one", "Say two", "Say three"], pair="tiny", enqueue=False,
                            max_new_tokens=4)
        run_inline(sessions=client.sessions, engine=engine, pair="tiny", job_id=job.id,
                   progress=False)
        code, _, err = run(["webhooks", "send", "--once"], capsys)
        assert code == 0 and "1 webhook deliveries posted" in err
        ((body, head),) = got
        openai.OpenAI(api_key="unused").webhooks.verify_signature(body, head, secret=secret)
        event = json.loads(body)
        assert event["type"] == "job.completed" and event["data"]["id"] == job.id
        assert event["data"]["request_counts"] == {"total": 3, "pending": 0, "completed": 3,
                                                   "failed": 0, "cancelled": 0}
        assert run(["webhooks", "send", "--once"], capsys)[2].startswith("0 webhook")
        assert len(got) == 1
    finally:
        receiver.shutdown()
        receiver.server_close()
