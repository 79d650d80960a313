"""The control plane's collector (api/exporter.py) against what the database and the broker
hold: queue depth per pair and priority, waiting chunks and their age, jobs by status, the
reconcilers' counts, and what it says when the database or the broker is away."""

from __future__ import annotations

import uuid

import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specq.api import exporter
from specq.api.client import Client
from specq.broker import reconciler
from specq.configs.settings import Settings
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import ItemStatus
from specq.db.outcomes import Outcome
from specq.schema.counters import Counters
from tests.conftest import fresh_pg_database


@pytest.fixture(params=["sqlite", "postgresql"])
def client(request, data_dir, tmp_path):
    """A client on an empty database of its own (the exporter counts every job in it)."""
    prefix = f"specq-exp-{uuid.uuid4().hex[:6]}"

    def make(url: str) -> Client:
        return Client(Settings(database_url=url, data_dir=data_dir, chunk_size=4,
                               broker_url="redis://127.0.0.1:6379/15", queue_prefix=prefix),
                      auto_migrate=True)

    if request.param == "sqlite":
        yield make(f"sqlite:///{tmp_path / 'specq.db'}")
    else:
        with fresh_pg_database() as url:
            yield make(url)
    redis.Redis(host="127.0.0.1", port=6379, db=15).delete(f"{prefix}:reconciler-actions")


def scrape(settings: Settings, sessions=None) -> dict[tuple[str, tuple], float]:
    text = generate_latest(exporter.registry(settings, sessions)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def done(i: int) -> Outcome:
    return Outcome(i, ItemStatus.completed, output="o", token_ids=[1], finish_reason="length",
                   prompt_tokens=1, counters=Counters(new_tokens=1), worker="w")


def test_queue_depth_jobs_and_reconciler_counts(client):
    high = client.submit([f"a {i}" for i in range(10)], pair="tiny", priority="high",
                         enqueue=False)  # chunks [0, 4), [4, 8), [8, 10)
    client.submit([f"b {i}" for i in range(5)], pair="tiny-lookup", enqueue=False)
    finished = client.submit(["c"], pair="tiny", enqueue=False)
    finished.cancel()
    with client.sessions.begin() as s:
        repo.write_outcomes(s, job_id=high.id, outcomes=[done(i) for i in range(0, 5)])
        chunks.mark_done(s, job_id=high.id, start=0)  # its 4 items written
        assert chunks.claim(s, job_id=high.id, start=4, owner="w1", ttl=300) == 1
    reconciler.count_actions(client.settings, runs=3, resent=2, refilled=5)

    got = scrape(client.settings)
    tiny_high = (("pair", "tiny"), ("priority", "high"))
    lookup = (("pair", "tiny-lookup"), ("priority", "normal"))
    assert got[("specq_unfinished_items", tiny_high)] == 5  # 10 less the 5 written
    assert got[("specq_unfinished_chunks", tiny_high)] == 2
    assert got[("specq_waiting_chunks", tiny_high)] == 1  # [4, 8) is leased
    assert (got[("specq_unfinished_items", lookup)], got[("specq_unfinished_chunks", lookup)],
            got[("specq_waiting_chunks", lookup)]) == (5, 2, 2)
    assert not any(k[0].startswith("specq_unfinished") and ("priority", "normal") in k[1]
                   and ("pair", "tiny") in k[1] for k in got)  # the cancelled job: none
    assert 0 <= got[("specq_oldest_waiting_seconds", (("pair", "tiny"),))] < 600
    jobs = {dict(k[1])["status"]: v for k, v in got.items() if k[0] == "specq_jobs"}
    assert jobs["queued"] == 2 and jobs["cancelled"] == 1 and jobs["completed"] == 0
    actions = {dict(k[1])["action"]: v for k, v in got.items()
               if k[0] == "specq_reconciler_actions_total"}
    assert actions == {"runs": 3, "resent": 2, "refilled": 5, "settled": 0, "abandoned": 0,
                       "database_errors": 0}
    assert got[("specq_database_up", ())] == got[("specq_broker_up", ())] == 1


def test_a_database_or_broker_away_is_a_gauge_not_an_error(client):
    no_broker = client.settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0",
                                                   "broker_timeout": 1.0})
    got = scrape(no_broker)
    assert got[("specq_broker_up", ())] == 0 and got[("specq_database_up", ())] == 1
    assert got[("specq_exporter_errors_total", (("source", "broker"),))] == 1
    assert not any(k[0] == "specq_reconciler_actions_total" for k in got)
    no_db = client.settings.model_copy(update={
        "database_url": "postgresql+psycopg://nobody@127.0.0.1:1/none"})
    got = scrape(no_db)
    assert got[("specq_database_up", ())] == 0 and got[("specq_broker_up", ())] == 1
    assert not any(k[0].startswith(("specq_unfinished", "specq_jobs")) for k in got)


def test_webhook_backlog_and_retention_counts(client):
    from specq.api.retention import SweepReport, count_swept, swept_key
    from specq.db import webhooks

    with client.sessions.begin() as s:
        webhooks.add_endpoint(s, url="http://127.0.0.1:9/h", tenant_id=None,
                              allow_private=True, allow_http=True)
    for _ in range(3):  # each ends at once: three job.cancelled deliveries pending
        client.submit(["x"], pair="tiny", enqueue=False).cancel()
    count_swept(client.settings, SweepReport(files=2, file_bytes=300, items_emptied=7))
    try:
        got = scrape(client.settings)
    finally:
        redis.Redis(host="127.0.0.1", port=6379, db=15).delete(swept_key(client.settings))
    assert got[("specq_webhook_deliveries", (("status", "pending"),))] == 3
    assert got[("specq_webhook_deliveries", (("status", "failed"),))] == 0
    assert 0 <= got[("specq_webhook_oldest_pending_seconds", ())] < 600
    swept = {dict(k[1])["what"]: v for k, v in got.items()
             if k[0] == "specq_retention_swept_total"}
    assert swept["files"] == 2 and swept["file_bytes"] == 300 and swept["items_emptied"] == 7
    assert swept["jobs_deleted"] == 0
