"""The chunk task's code in-process: idempotent on redelivery, per-item failures."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from specq.api.client import Client
from specq.configs.presets import get_preset
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import Chunk, Item, ItemStatus, JobStatus
from specq.db.session import migrate
from specq.worker.pairs import load_pair
from specq.worker.tasks import run_chunk, run_inline
from tests.conftest import fresh_pg_database
from tests.pipeline.conftest import stored_unsent


@pytest.fixture(scope="module")
def own_client(settings):
    """A client on a database of this module's own: these chunks run here, in-process,
    some of them of jobs with a queue (stored_unsent), which a session worker's reconciler
    (on the session's database) would send meanwhile."""
    with fresh_pg_database() as url:
        migrate(url)
        yield Client(settings.model_copy(update={"database_url": url}))


@pytest.fixture(scope="module")
def engine(settings):
    return load_pair(get_preset("tiny"), settings).engine(max_batch_size=4)


def test_a_redelivered_chunk_changes_nothing(own_client, engine):
    job = own_client.submit([f"Fix: item {i}" for i in range(6)], pair="tiny", enqueue=False,
                            max_new_tokens=6, chunk_size=6)
    args = dict(sessions=own_client.sessions, engine=engine, pair="tiny", job_id=job.id,
                start=0, end=6)
    first = run_chunk(hostname="first", **args)
    before = [it.as_dict() for it in job.results()]
    again = run_chunk(hostname="second", **args)
    assert (first.written, first.job_status) == (6, JobStatus.completed.value)
    assert (again.written, again.skipped) == (0, 6)
    assert [it.as_dict() for it in job.results()] == before
    assert {it.worker for it in job.results()} == {"first"}


def test_an_item_the_engine_refuses_fails_alone(own_client, engine):
    job = own_client.submit(["Fix: he go", "Fix: she go", "Fix: they goes"], pair="tiny",
                            enqueue=False, max_new_tokens=6, chunk_size=2)
    with own_client.sessions.begin() as s:  # as if the prompt had changed since validation
        item = repo.pending_items(s, job_id=job.id, start=1, end=2)[0]
        item.prompt = "word " * 600
    run_inline(sessions=own_client.sessions, engine=engine, pair="tiny", job_id=job.id,
               progress=False)
    items = list(job.results())
    assert [it.status for it in items] == [ItemStatus.completed.value, ItemStatus.failed.value,
                                           ItemStatus.completed.value]
    assert "context" in items[1].error and items[1].output is None
    assert job.status(check_workers=False).status == JobStatus.completed.value


def test_a_chunk_of_a_cancelling_job_is_cancelled_not_generated(own_client, engine):
    job = stored_unsent(own_client, [f"Fix: item {i}" for i in range(4)], pair="tiny",
                        max_new_tokens=4, chunk_size=2)
    run_chunk(sessions=own_client.sessions, engine=engine, pair="tiny", job_id=job.id,
              start=0, end=2, hostname="h")
    with own_client.sessions.begin() as s:  # chunk [2, 4)'s message is on its way
        assert [r.start for r in chunks.take_unsent(s, job_id=job.id, n=1)] == [2]
    assert job.cancel().status == JobStatus.cancelling.value
    report = run_chunk(sessions=own_client.sessions, engine=engine, pair="tiny", job_id=job.id,
                       start=2, end=4, hostname="h")
    assert (report.cancelled, report.written, report.job_status) == (2, 0, "cancelled")
    assert [it.status for it in job.results()] == ["completed"] * 2 + ["cancelled"] * 2


def test_cancelling_a_running_job_ends_the_chunks_not_sent_yet_at_once(own_client, engine):
    job = own_client.submit([f"Fix: item {i}" for i in range(6)], pair="tiny", enqueue=False,
                            max_new_tokens=4, chunk_size=2)
    run_chunk(sessions=own_client.sessions, engine=engine, pair="tiny", job_id=job.id,
              start=0, end=2, hostname="h")
    assert job.cancel().status == JobStatus.cancelled.value  # [2, 4) and [4, 6) never sent
    assert [it.status for it in job.results()] == ["completed"] * 2 + ["cancelled"] * 4


# -- every other way a chunk can end -------------------------------------------------------


def _job(client, n=4, chunk_size=4, **kw):
    return client.submit([f"Fix: item {i} of {n}" for i in range(n)], pair="tiny",
                         enqueue=False, max_new_tokens=4, chunk_size=chunk_size, **kw)


def _run(client, engine, job, start=0, end=4, pair="tiny", **kw):
    return run_chunk(sessions=client.sessions, engine=engine, pair=pair, job_id=job.id,
                     start=start, end=end, hostname="h", **kw)


def test_a_chunk_of_a_job_that_is_gone_is_dropped(own_client, engine):
    report = run_chunk(sessions=own_client.sessions, engine=engine, pair="tiny",
                       job_id=2**31 - 1, start=0, end=4, hostname="h")
    assert report.note == "job not found; chunk dropped" and report.written == 0


def test_a_chunk_of_a_finished_job_is_skipped_and_marked_done(own_client, engine):
    job = _job(own_client)
    assert _run(own_client, engine, job).job_status == "completed"
    with own_client.sessions.begin() as s:  # as if a re-sent message came back later
        s.execute(update(Chunk).where(Chunk.job_id == job.id).values(done=False))
    report = _run(own_client, engine, job)
    assert (report.written, report.skipped, report.job_status) == (0, 4, "completed")
    with own_client.sessions() as s:
        assert s.get(Chunk, (job.id, 0), populate_existing=True).done


def test_a_chunk_for_another_pair_is_refused_and_changes_nothing(own_client, engine):
    job = _job(own_client)
    with pytest.raises(RuntimeError, match="is for pair 'tiny'; this worker: 'tiny-lookup'"):
        _run(own_client, engine, job, pair="tiny-lookup")
    assert job.status(check_workers=False).pending == 4


def test_a_chunk_another_worker_holds_is_left_to_it(own_client, engine):
    job = _job(own_client)
    with own_client.sessions.begin() as s:
        chunks.claim(s, job_id=job.id, start=0, owner="other", ttl=60)
    report = _run(own_client, engine, job)
    assert report.note == "another worker holds the chunk's lease" and report.written == 0
    assert job.status(check_workers=False).pending == 4


def test_a_chunk_no_worker_ever_finishes_fails_its_items_with_the_reason(own_client, engine,
                                                                        settings):
    job = _job(own_client)
    with own_client.sessions.begin() as s:  # 20 workers took it and died (a crashing prompt)
        s.execute(update(Chunk).where(Chunk.job_id == job.id).values(runs=20))
    report = _run(own_client, engine, job, settings=settings)
    assert report.failed == 4 and report.job_status == "completed"
    items = list(job.results())
    assert all(it.status == "failed" and "chunk abandoned: 20 workers" in it.error
               for it in items)


def test_an_item_whose_stored_request_is_invalid_fails_alone(own_client, engine):
    job = _job(own_client)
    with own_client.sessions.begin() as s:  # as if edited in the database since validation
        s.execute(update(Item).where(Item.job_id == job.id, Item.index == 2)
                  .values(params={"temperature": -1.0}))
    assert _run(own_client, engine, job).job_status == "completed"
    items = list(job.results())
    assert [it.status for it in items] == ["completed"] * 2 + ["failed", "completed"]
    assert "temperature" in items[2].error


def test_an_outcome_the_database_refuses_fails_that_item_saying_why(own_client, engine):
    job = _job(own_client)
    generate = engine.generate

    def overflowing(requests, on_result=None, **kw):  # one result no INTEGER column holds
        def seen(result):
            if result.id == 1:
                result.prompt_tokens = 2**40
            on_result(result)
        return generate(requests, on_result=seen, **kw)

    engine.generate = overflowing
    try:
        report = _run(own_client, engine, job)
    finally:
        del engine.generate
    items = list(job.results())
    assert [it.status for it in items] == ["completed", "failed", "completed", "completed"]
    assert items[1].error.startswith("could not store the outcome")
    assert report.job_status == "completed"
    with own_client.sessions() as s:
        assert s.scalars(select(Item.writes).where(Item.job_id == job.id)).all() == [1] * 4
