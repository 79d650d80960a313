"""The chunk task's code in-process: idempotent on redelivery, per-item failures."""

from __future__ import annotations

import pytest

from specq.configs.presets import get_preset
from specq.db import repository as repo
from specq.db.models import ItemStatus, JobStatus
from specq.worker.pairs import load_pair
from specq.worker.tasks import run_chunk, run_inline


@pytest.fixture(scope="module")
def engine(settings):
    return load_pair(get_preset("tiny"), settings).engine(max_batch_size=4)


def test_a_redelivered_chunk_changes_nothing(client, engine):
    job = client.submit([f"Fix: item {i}" for i in range(6)], pair="tiny", enqueue=False,
                        max_new_tokens=6, chunk_size=6)
    args = dict(sessions=client.sessions, engine=engine, pair="tiny", job_id=job.id, start=0,
                end=6)
    first = run_chunk(hostname="first", **args)
    before = [it.as_dict() for it in job.results()]
    again = run_chunk(hostname="second", **args)
    assert (first.written, first.job_status) == (6, JobStatus.completed.value)
    assert (again.written, again.skipped) == (0, 6)
    assert [it.as_dict() for it in job.results()] == before
    assert {it.worker for it in job.results()} == {"first"}


def test_an_item_the_engine_refuses_fails_alone(client, engine):
    job = client.submit(["Fix: he go", "Fix: she go", "Fix: they goes"], pair="tiny",
                        enqueue=False, max_new_tokens=6, chunk_size=2)
    with client.sessions.begin() as s:  # as if the prompt had changed since validation
        item = repo.pending_items(s, job_id=job.id, start=1, end=2)[0]
        item.prompt = "word " * 600
    run_inline(sessions=client.sessions, engine=engine, pair="tiny", job_id=job.id,
               progress=False)
    items = list(job.results())
    assert [it.status for it in items] == [ItemStatus.completed.value, ItemStatus.failed.value,
                                           ItemStatus.completed.value]
    assert "context" in items[1].error and items[1].output is None
    assert job.status(check_workers=False).status == JobStatus.completed.value


def test_a_chunk_of_a_cancelling_job_is_cancelled_not_generated(client, engine):
    job = client.submit([f"Fix: item {i}" for i in range(4)], pair="tiny", enqueue=False,
                        max_new_tokens=4, chunk_size=2)
    run_chunk(sessions=client.sessions, engine=engine, pair="tiny", job_id=job.id, start=0, end=2,
              hostname="h")
    assert job.cancel().status == JobStatus.cancelling.value
    report = run_chunk(sessions=client.sessions, engine=engine, pair="tiny", job_id=job.id,
                       start=2, end=4, hostname="h")
    assert (report.cancelled, report.written, report.job_status) == (2, 0, "cancelled")
    assert [it.status for it in job.results()] == ["completed"] * 2 + ["cancelled"] * 2
