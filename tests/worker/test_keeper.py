"""The keeper's launch marks: one statement on the engine's thread, outcomes left queued."""

from __future__ import annotations

import pytest

from specq.configs.settings import get_settings
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import Item, ItemStatus, JobStatus
from specq.db.outcomes import Outcome
from specq.db.session import migrate, session_factory
from specq.worker.keeper import ChunkKeeper


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request, tmp_path):
    url = (f"sqlite:///{tmp_path / 'specq.db'}" if request.param == "sqlite"
           else request.getfixturevalue("pg_url"))
    migrate(url)
    return session_factory(url)


def _job(sessions, n: int) -> int:
    with sessions.begin() as s:
        job = repo.create_job(s, pair="tiny", params={}, chunk_size=n, source=None,
                              queue="q.tiny")
        rows = ({"index": i, "custom_id": None, "prompt": f"p{i}", "messages": None,
                 "params": None} for i in range(n))
        job.total = repo.insert_items(s, job_id=job.id, rows=rows)
        job.status = JobStatus.queued.value
        chunks.insert_chunks(s, job_id=job.id, total=n, chunk_size=n)
        return job.id


def test_a_launch_writes_no_outcome_and_unmarks_the_finished(sessions):
    """A launch marks its batch and clears the marks of the items finished before it, in one
    transaction, and leaves their outcomes to the keeper: they are written at close (the
    keeper's thread, not started here, would write them in its own time)."""
    settings = get_settings().model_copy(update={"flush_items": 1000, "flush_every": 3600.0})
    job_id = _job(sessions, 5)
    with sessions.begin() as s:  # the run's lease: only its owner writes marks and outcomes
        assert chunks.claim(s, job_id=job_id, start=0, owner="host/1/abcd", ttl=600)
    keeper = ChunkKeeper(sessions, settings, job_id, 0, 5, "host/1/abcd")
    keeper.launch([0, 1, 2], generation=1)
    keeper.put(Outcome(0, ItemStatus.completed, output="a", token_ids=[1]))
    keeper.put(Outcome(1, ItemStatus.completed, output="b", token_ids=[1]))
    keeper.launch([3, 4], generation=1)

    def items() -> list[Item]:
        with sessions() as s:
            return [s.get(Item, (job_id, i)) for i in range(5)]

    assert [it.status for it in items()] == ["pending"] * 5  # the launch wrote nothing
    assert [it.launch for it in items()] == [None, None, "host/1/abcd#1", "host/1/abcd#1",
                                             "host/1/abcd#1"]
    report = keeper.close()
    assert report.written == 2
    assert [(it.status, it.output) for it in items()][:2] == [("completed", "a"),
                                                              ("completed", "b")]


def test_a_launch_after_its_connection_died_marks_on_a_fresh_one(pg_url):
    """On PostgreSQL a run's launches share one autocommit connection (one round trip a
    launch). The server ending that connection costs one mark (an outage's rule: the launch
    goes on unmarked, logged) and never the next: it takes a fresh connection."""
    from sqlalchemy import text

    migrate(pg_url)
    sessions = session_factory(pg_url)
    job_id = _job(sessions, 6)
    with sessions.begin() as s:
        assert chunks.claim(s, job_id=job_id, start=0, owner="host/2/efgh", ttl=600)
    keeper = ChunkKeeper(sessions, get_settings(), job_id, 0, 6, "host/2/efgh")
    keeper.launch([0, 1], generation=1)
    launcher = keeper._launcher
    assert launcher is not None
    backend = launcher.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    with sessions.begin() as s:  # as a server restart or an idle timeout would
        s.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": backend})
    keeper.launch([2, 3], generation=2)  # unmarked: the connection was gone
    keeper.launch([4, 5], generation=3)  # a fresh connection
    assert keeper._launcher is not None and keeper._launcher is not launcher
    with sessions() as s:
        marks = [s.get(Item, (job_id, i)).launch for i in range(6)]
    assert marks == ["host/2/efgh#1"] * 2 + [None] * 2 + ["host/2/efgh#3"] * 2
    keeper.close()
    assert keeper._launcher is None  # closed with the run
