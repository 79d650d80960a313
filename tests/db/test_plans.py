"""The hot queries' plans on PostgreSQL do not depend on the table statistics.

The worst case a user meets: statistics taken while every item was written (ANALYZE after
a finished job: pending items look rare), then a 100,000-item job stored by one bulk insert
(no ANALYZE since). Every statement a worker, the reconciler or a status read runs is
captured as SQLAlchemy sends it, then run again under EXPLAIN ANALYZE: none may scan a table
whole, and each reads about the rows it needs (the rows an index scan returned or filtered
out), not the job's whole pending set.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, text, update

from specq.api import exporter
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import Chunk, Item, ItemStatus, JobStatus
from specq.db.outcomes import Outcome
from specq.db.session import get_engine, migrate, session_factory
from specq.schema.counters import Counters
from tests.conftest import fresh_pg_database

N = 100_000
CHUNK = 500
TABLES = {"items", "chunks", "jobs"}


def _job(sessions, n: int) -> int:
    with sessions.begin() as s:
        job = repo.create_job(s, pair="tiny", params={}, chunk_size=CHUNK, source=None,
                              queue="q.tiny")
        rows = ({"index": i, "custom_id": None, "prompt": f"p{i}", "messages": None,
                 "params": None} for i in range(n))
        job.total = repo.insert_items(s, job_id=job.id, rows=rows, batch=5000)
        job.status = JobStatus.in_progress.value
        chunks.insert_chunks(s, job_id=job.id, total=n, chunk_size=CHUNK)
        return job.id


@pytest.fixture(scope="module")
def stale():
    """(sessions, engine, id of a 100,000-item job stored after the last ANALYZE, which
    saw only written items)."""
    with fresh_pg_database() as url:
        migrate(url)
        sessions = session_factory(url)
        old = _job(sessions, N)
        with sessions.begin() as s:
            s.execute(update(Item).where(Item.job_id == old)
                      .values(status=ItemStatus.completed.value, writes=1))
        engine = get_engine(url)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))
        yield sessions, engine, _job(sessions, N)
        engine.dispose()


@contextmanager
def captured(engine) -> Iterator[list[tuple[str, Any]]]:
    """The statements (with their first parameter set) sent while inside."""
    got: list[tuple[str, Any]] = []

    def grab(conn, cursor, statement, parameters, context, executemany):
        got.append((statement, parameters[0] if executemany else parameters))

    event.listen(engine, "before_cursor_execute", grab)
    try:
        yield got
    finally:
        event.remove(engine, "before_cursor_execute", grab)


def plans(engine, statements: list[tuple[str, Any]]) -> list[dict]:
    """Each statement's EXPLAIN ANALYZE plan (run in a transaction that is rolled back)."""
    out = []
    for statement, params in statements:
        if not statement.lstrip().upper().startswith(("SELECT", "UPDATE", "WITH")):
            continue
        with engine.connect() as conn:
            raw = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}",
                                       params or {}).scalar()
            conn.rollback()
        plan = raw if isinstance(raw, list) else json.loads(raw)
        out.append({"sql": statement, "plan": plan[0]["Plan"]})
    return out


def _nodes(node: dict) -> Iterator[dict]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def rows_read(plan: dict) -> int:
    """Rows of items and chunks that scans returned or filtered out, over all loops."""
    n = 0
    for node in _nodes(plan):
        if node.get("Relation Name") in ("items", "chunks"):
            loops = node.get("Actual Loops", 1)
            n += (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
                  + node.get("Rows Removed by Index Recheck", 0)) * loops
    return n


def whole_scans(plan: dict) -> list[str]:
    return [node["Relation Name"] for node in _nodes(plan)
            if node["Node Type"] == "Seq Scan" and node.get("Relation Name") in TABLES - {"jobs"}]


def _done(i: int) -> Outcome:
    return Outcome(i, ItemStatus.completed, output="o", token_ids=[1], finish_reason="length",
                   prompt_tokens=1, counters=Counters(new_tokens=1), worker="w")


START = N // 2  # a chunk in the middle of the job


CALLS: dict[str, tuple[Callable[[Any, int], Any], int]] = {
    # name: (the call, the most rows of items and chunks it may read)
    "a chunk's pending items": (
        lambda s, j: repo.pending_items(s, job_id=j, start=START, end=START + CHUNK), CHUNK),
    "a run's reading of them": (
        lambda s, j: repo.pending_work(s, job_id=j, start=START, end=START + CHUNK), CHUNK),
    "write-once outcomes": (
        lambda s, j: repo.write_outcomes(s, job_id=j, outcomes=[_done(START + 1),
                                                                 _done(START + 2)]), 4),
    "the chunk's lease": (
        lambda s, j: chunks.claim(s, job_id=j, start=START, owner="w", ttl=30), 2),
    "the job's next chunk to send": (lambda s, j: chunks.take_unsent(s, job_id=j, n=1), 4),
    "the chunk's release": (
        lambda s, j: chunks.release(s, job_id=j, start=START, end=START + CHUNK, owner="w"),
        CHUNK + 2),
    "settling the job": (lambda s, j: repo.settle_job(s, job_id=j), 4),
    "jobs to settle": (lambda s, j: repo.unsettled_jobs(s), 8),
    "status counts": (lambda s, j: repo.status_counts(s, job_id=j), N // CHUNK + 2),
    # the metrics: a count of the job's items by status, a sum of its chunks
    "metrics": (lambda s, j: (repo.job_figures(s, job_ids=[j]),
                              repo.accepted_by_position(s, job_id=j),
                              repo.steps_by_draft_length(s, job_id=j),
                              repo.chunk_timeline(s, job_id=j)), 6 * N // CHUNK),
    # every item of the job, none of the other's, in index order without sorting
    "export": (lambda s, j: next(repo.iter_items(s, job_id=j, batch=1000)), N),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_hot_queries_read_only_the_rows_they_need(stale, name):
    sessions, engine, job_id = stale
    call, most = CALLS[name]
    with captured(engine) as statements:
        with sessions() as s:
            call(s, job_id)
            s.rollback()
    found = plans(engine, statements)
    assert found, f"{name}: no statement captured"
    for p in found:
        assert not whole_scans(p["plan"]), f"{name}: a whole-table scan in {p['sql']}"
        assert not any(n["Node Type"] == "Sort" and n.get("Actual Rows", 0) > CHUNK
                       for n in _nodes(p["plan"])), f"{name}: a sort of many rows in {p['sql']}"
        assert rows_read(p["plan"]) <= most, (
            f"{name}: read {rows_read(p['plan'])} rows (at most {most}) in {p['sql']}")


@pytest.fixture(scope="module")
def fleet_history():
    """(sessions, engine, number of unfinished chunks): a database as a fleet leaves it after
    a while, its statistics fresh: 50 finished jobs of 400 chunks each (all done), and a
    1,000,000-item job in progress (2,000 chunks of 500; its items are not stored here, the
    exporter never reads items)."""
    with fresh_pg_database() as url:
        migrate(url)
        sessions = session_factory(url)
        with sessions.begin() as s:
            for _ in range(50):
                job = repo.create_job(s, pair="tiny", params={}, chunk_size=CHUNK, source=None,
                                      queue="q.tiny")
                job.total, job.status = 400 * CHUNK, JobStatus.completed.value
                chunks.insert_chunks(s, job_id=job.id, total=job.total, chunk_size=CHUNK)
                s.execute(update(Chunk).where(Chunk.job_id == job.id).values(done=True))
            big = repo.create_job(s, pair="tiny", params={}, chunk_size=CHUNK, source=None,
                                  queue="q.tiny")
            big.total, big.status = 1_000_000, JobStatus.in_progress.value
            open_chunks = chunks.insert_chunks(s, job_id=big.id, total=big.total,
                                               chunk_size=CHUNK)
        engine = get_engine(url)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))
        yield sessions, engine, open_chunks
        engine.dispose()


def test_the_exporter_reads_the_unfinished_chunks_only(fleet_history):
    """A scrape of the control plane (api/exporter.py) reads each unfinished job's chunks
    not done (three times: chunks, items left, waiting) and no finished job's, never an
    item: its cost follows the work left, not the history nor the items stored."""
    sessions, engine, open_chunks = fleet_history
    with captured(engine) as statements:
        with sessions() as s:
            rows = exporter.unfinished(s)
            exporter.jobs_by_status(s)
    assert [(r.chunks, r.items) for r in rows] == [(open_chunks, 1_000_000)]
    found = plans(engine, statements)
    assert len(found) == 2
    for p in found:
        assert not whole_scans(p["plan"]), f"a whole-table scan in {p['sql']}"
        assert rows_read(p["plan"]) <= 3 * open_chunks, p["sql"]
        assert "items" not in {n.get("Relation Name") for n in _nodes(p["plan"])}
