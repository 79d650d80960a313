"""Jobs and items in SQL: migrations, bulk inserts, idempotent writes, derived metrics."""

from __future__ import annotations

import pytest
from sqlalchemy import func, inspect, select
from sqlalchemy.exc import IntegrityError

from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import Item, ItemStatus, JobStatus
from specq.db.outcomes import Outcome
from specq.db.session import get_engine, migrate
from specq.schema.counters import Counters


def _job(sessions, n=10, chunk_size=4):
    with sessions.begin() as s:
        job = repo.create_job(s, pair="tiny", params={"max_new_tokens": 8}, chunk_size=chunk_size,
                              source=None)
        rows = ({"index": i, "custom_id": f"c{i}", "prompt": f"p{i}", "messages": None,
                 "params": None} for i in range(n))
        job.total = repo.insert_items(s, job_id=job.id, rows=rows, batch=3)
        job.status = JobStatus.queued.value
        chunks.insert_chunks(s, job_id=job.id, total=n, chunk_size=chunk_size)
        return job.id


def _outcome(index, accepted_by_position, draft_steps=2, new_tokens=5, output=None):
    counters = Counters(
        draft_steps=draft_steps, proposed=4 * draft_steps, accepted=sum(accepted_by_position),
        accepted_by_position=accepted_by_position, target_passes=3, new_tokens=new_tokens,
        steps_by_draft_length=[1, draft_steps], draft_time=0.5, verify_time=0.25,
        steps_by_drafts_verified=[1] + [0] * (draft_steps - 1) + [draft_steps])
    return Outcome(index, ItemStatus.completed, output=output or f"out{index}",
                   token_ids=[1, 2], finish_reason="length", prompt_tokens=3,
                   counters=counters, worker="w")


def test_migration_creates_every_table(db_url):
    names = set(inspect(get_engine(db_url)).get_table_names())
    assert {"jobs", "items", "alembic_version"} <= names


def test_sqlite_runs_in_wal_mode(tmp_path):
    url = f"sqlite:///{tmp_path / 'specq.db'}"
    migrate(url)
    with get_engine(url).connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_items_are_stored_in_batches_and_chunked(sessions):
    job_id = _job(sessions, n=10, chunk_size=4)
    with sessions() as s:
        job = repo.get_job(s, job_id=job_id)
        assert job.total == 10
        assert chunks.ranges(s, job_id=job_id) == [(0, 4), (4, 8), (8, 10)]
        assert [(r.start, r.end) for r in chunks.containing(s, job_id=job_id,
                                                            indices=[9, 0, 3, 8])] == [
            (0, 4), (8, 10)]
        assert [it.index for it in repo.iter_items(s, job_id=job_id, batch=3)] == list(range(10))
        assert repo.status_counts(s, job_id=job_id)["pending"] == 10


def test_custom_id_is_unique_per_job(sessions):
    job_id = _job(sessions, n=2)
    with pytest.raises(IntegrityError), sessions.begin() as s:
        repo.insert_items(s, job_id=job_id, rows=[{"index": 5, "custom_id": "c0", "prompt": "x",
                                                   "messages": None, "params": None}])
    _job(sessions, n=2)  # the same custom ids in another job are fine


def test_outcomes_are_written_once(sessions):
    job_id = _job(sessions, n=4, chunk_size=4)
    first = [_outcome(i, [1, 1]) for i in range(4)]
    with sessions.begin() as s:
        repo.lock_job(s, job_id=job_id)
        assert repo.write_outcomes(s, job_id=job_id, outcomes=first) == 4
        assert repo.settle_job(s, job_id=job_id) == JobStatus.completed
    again = [_outcome(i, [0], output="rewritten") for i in range(4)]
    with sessions.begin() as s:
        repo.lock_job(s, job_id=job_id)
        assert repo.write_outcomes(s, job_id=job_id, outcomes=again) == 0
    with sessions() as s:
        items = list(repo.iter_items(s, job_id=job_id))
    assert [it.output for it in items] == [f"out{i}" for i in range(4)]
    assert all(it.writes == 1 for it in items)


def test_job_completes_only_when_no_item_is_pending(sessions):
    job_id = _job(sessions, n=6, chunk_size=3)
    with sessions.begin() as s:
        repo.lock_job(s, job_id=job_id)
        repo.start_job(s, job_id=job_id)
        repo.write_outcomes(s, job_id=job_id, outcomes=[_outcome(i, [1]) for i in range(3)])
        assert repo.settle_job(s, job_id=job_id) == JobStatus.in_progress
    with sessions.begin() as s:
        repo.lock_job(s, job_id=job_id)
        repo.write_outcomes(s, job_id=job_id, outcomes=[_outcome(i, [1]) for i in range(3, 6)])
        assert repo.settle_job(s, job_id=job_id) == JobStatus.completed


def test_metrics_are_sql_sums_of_item_counters(sessions):
    job_id = _job(sessions, n=3)
    outcomes = [_outcome(0, [2, 1], draft_steps=2), _outcome(1, [1], draft_steps=1),
                _outcome(2, [3, 2, 1], draft_steps=3)]
    with sessions.begin() as s:
        repo.lock_job(s, job_id=job_id)
        repo.write_outcomes(s, job_id=job_id, outcomes=outcomes)
    with sessions() as s:
        (sums,) = repo.job_figures(s, job_ids=[job_id])
        assert repo.accepted_by_position(s, job_id=job_id) == [6, 3, 1]
        assert repo.steps_by_draft_length(s, job_id=job_id) == [3, 6]
        # per row: 1 plain step each, and 2, 1, 3 steps at 2, 1, 3 drafts verified
        assert repo.steps_by_drafts_verified(s, job_id=job_id) == [3, 1, 2, 3]
        assert sums["accepted"] == 10 and sums["draft_steps"] == 6 and sums["proposed"] == 24
        assert sums["new_tokens"] == 15 and sums["draft_time"] == pytest.approx(1.5)
        assert s.scalar(select(func.count()).select_from(Item)) >= 3


def test_cancel_of_a_queued_job_ends_it_at_once(sessions):
    job_id = _job(sessions, n=5)
    with sessions.begin() as s:
        assert repo.request_cancel(s, job_id=job_id) == JobStatus.cancelled
    with sessions() as s:
        assert repo.status_counts(s, job_id=job_id)["cancelled"] == 5


def test_cancel_of_a_running_job_waits_for_its_chunks(sessions):
    job_id = _job(sessions, n=4, chunk_size=2)
    with sessions.begin() as s:
        repo.lock_job(s, job_id=job_id)
        repo.start_job(s, job_id=job_id)
        repo.write_outcomes(s, job_id=job_id, outcomes=[_outcome(0, [1]), _outcome(1, [1])])
        chunks.claim(s, job_id=job_id, start=2, owner="w", ttl=60)  # a worker runs [2, 4)
    with sessions.begin() as s:
        assert repo.request_cancel(s, job_id=job_id) == JobStatus.cancelling
    with sessions.begin() as s:
        repo.lock_job(s, job_id=job_id)
        assert repo.cancel_pending(s, job_id=job_id, start=2, end=4) == 2
        assert repo.settle_job(s, job_id=job_id) == JobStatus.cancelled
    with sessions() as s:
        counts = repo.status_counts(s, job_id=job_id)
    assert counts["completed"] == 2 and counts["cancelled"] == 2


def test_the_migrations_build_the_schema_the_models_describe(db_url):
    """Migrations are written out by hand (they are history); the models derive from one
    definition (the counters of schema/counters.py among them): they must agree."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from specq.db.models import Base

    with get_engine(db_url).connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
