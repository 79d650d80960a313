"""Jobs and items in SQL: migrations, bulk inserts, idempotent writes, derived metrics."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from sqlalchemy import func, inspect, select
from sqlalchemy.exc import IntegrityError

from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import Chunk, Item, ItemStatus, JobStatus
from specq.db.outcomes import COLUMNS as OUTCOME_COLUMNS
from specq.db.outcomes import Outcome, storable
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


def _item_columns(sessions, job_id):
    """Every outcome column of the job's items, whether it is SQL NULL (JSON's null reads
    back as None too), and writes and launch, in index order."""
    t = Item.__table__
    with sessions() as s:
        return [tuple(r) for r in s.execute(
            select(*(t.c[c] for c in OUTCOME_COLUMNS),
                   *(t.c[c].is_(None) for c in OUTCOME_COLUMNS), t.c.writes, t.c.launch)
            .where(t.c.job_id == job_id).order_by(t.c.index))]


def _mixed_outcomes():
    """A completed item with every counter, a failure that never reached the engine (no
    counters, no token ids), one with NUL and a lone surrogate made storable, and times."""
    when = datetime(2026, 12, 3, 8, 0, 0, tzinfo=timezone.utc)
    return [_outcome(0, [2, 1], draft_steps=2),
            Outcome.failure(1, "boom", worker="w", started_at=when, finished_at=when),
            Outcome(2, ItemStatus.completed, output=storable("a\x00b\ud800"), token_ids=[],
                    finish_reason="stop", prompt_tokens=0, counters=Counters(), worker="w",
                    started_at=when, finished_at=when),
            # text that quoting gets wrong, floats at their edges, a time with microseconds
            # and another zone, a large id
            Outcome(3, ItemStatus.completed, output='{"a", b}\\ \n\t NULL \u00e9\U0001F600',
                    token_ids=[2**31 - 1, 0], finish_reason="stop", prompt_tokens=2**20,
                    counters=Counters(draft_time=0.1, verify_time=1e-300, mask_time=float("inf"),
                                      accepted_by_position=[0]),
                    worker='h,"q"', started_at=datetime(2026, 1, 2, 3, 4, 5, 678901,
                                                        tzinfo=timezone.utc),
                    finished_at=datetime.fromisoformat("2026-01-02T05:04:06.000001+02:00"))]


def test_one_statement_writes_what_one_per_item_writes(db_url, sessions, monkeypatch):
    """PostgreSQL writes a batch of outcomes in one statement over a JSON document: every
    column it stores (NULLs, JSON, times, floats, text made storable or hard to quote)
    equals what one UPDATE per item stores, and the writes and sums bookkeeping too."""
    if not db_url.startswith("postgresql"):
        pytest.skip("the one-statement write is PostgreSQL's")
    one_by_one = _job(sessions, n=4, chunk_size=4)
    at_once = _job(sessions, n=4, chunk_size=4)
    with sessions.begin() as s:
        monkeypatch.setattr(repo, "_store_set", repo._store_each)
        assert repo.write_outcomes(s, job_id=one_by_one, outcomes=_mixed_outcomes()) == 4
        monkeypatch.undo()
        assert repo.write_outcomes(s, job_id=at_once, outcomes=_mixed_outcomes()) == 4
    assert _item_columns(sessions, at_once) == _item_columns(sessions, one_by_one)
    failures = _job(sessions, n=2, chunk_size=2)  # every counter column all NULL
    with sessions.begin() as s:
        assert repo.write_outcomes(s, job_id=failures, outcomes=[
            Outcome.failure(i, "never ran") for i in range(2)]) == 2
    assert [r[:6] for r in _item_columns(sessions, failures)] == [
        ("failed", None, None, None, "never ran", None)] * 2
    with sessions() as s:
        assert (repo.job_figures(s, job_ids=[at_once])[0]["accepted"]
                == repo.job_figures(s, job_ids=[one_by_one])[0]["accepted"] == 3)
        assert repo.status_counts(s, job_id=at_once) == repo.status_counts(s, job_id=one_by_one)


def test_an_item_given_twice_is_written_once_with_its_first_outcome(sessions):
    job_id = _job(sessions, n=4, chunk_size=4)
    twice = [_outcome(1, [1], output="first"), _outcome(2, [1]),
             _outcome(1, [1, 1], output="second")]
    with sessions.begin() as s:
        written = repo.store_outcomes(s, job_id=job_id, outcomes=twice)
    assert [(o.index, o.output) for o in written] == [(1, "first"), (2, "out2")]
    with sessions() as s:
        items = {it.index: it for it in repo.iter_items(s, job_id=job_id)}
        (sums,) = repo.job_figures(s, job_ids=[job_id])
        (chunk,) = s.scalars(select(Chunk).where(Chunk.job_id == job_id))
    assert items[1].output == "first" and items[1].writes == 1
    assert sums["accepted"] == 2  # one item's counters each, not the repeat's
    assert chunk.completed == 2


def test_only_pending_items_of_a_batch_are_written_and_returned(sessions):
    """A batch that mixes written, pending and unknown items writes only the pending ones,
    returns exactly those, and adds only their counters to the chunk sums."""
    job_id = _job(sessions, n=6, chunk_size=3)
    with sessions.begin() as s:
        repo.write_outcomes(s, job_id=job_id, outcomes=[_outcome(0, [1]), _outcome(4, [1])])
    with sessions.begin() as s:
        written = repo.store_outcomes(s, job_id=job_id, outcomes=[
            _outcome(i, [2], output="late") for i in (0, 1, 4, 5, 99)])
    assert [o.index for o in written] == [1, 5]
    with sessions() as s:
        items = {it.index: it for it in repo.iter_items(s, job_id=job_id)}
        (sums,) = repo.job_figures(s, job_ids=[job_id])
        done = {c.start: c.completed for c in s.scalars(
            select(Chunk).where(Chunk.job_id == job_id))}
    assert [items[i].output for i in range(6)] == ["out0", "late", None, None, "out4", "late"]
    assert all(items[i].writes == (1 if i in (0, 1, 4, 5) else 0) for i in range(6))
    assert sums["accepted"] == 1 + 2 + 1 + 2
    assert done == {0: 2, 3: 2}
