"""One owner for a chunk's run, in-process on PostgreSQL: a superseded run's writes are
refused, a run whose database stalls gives its lease up before anyone may take over and
its items in flight are released, not charged; a fault record the database refuses is
dropped without holding the outcomes behind it. The stall is a real one: the keeper's
database path goes through a TCP proxy that holds every byte (bench/proxy.py)."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import pytest
import redis
from sqlalchemy import select, text, update
from sqlalchemy.engine import make_url

from specq.api.client import Client
from specq.bench.proxy import Proxy
from specq.broker import presence
from specq.configs.presets import get_preset
from specq.db import chunks
from specq.db import repository as repo
from specq.db.clock import db_now
from specq.db.models import Chunk, Item, ItemStatus
from specq.db.outcomes import Outcome
from specq.db.session import migrate, session_factory
from specq.worker.keeper import ChunkKeeper, Stopped
from specq.worker.pairs import load_pair
from specq.worker.run import BrokerLives
from specq.worker.tasks import run_chunk
from tests.conftest import fresh_pg_database, wait_until
from tests.pipeline.conftest import own_deployment


@pytest.fixture(scope="module")
def own(settings):
    """A database of this module's own (no session worker's reconciler acts on it) and a
    deployment prefix of its own; leases of 6 s."""
    with fresh_pg_database() as url:
        migrate(url)
        yield own_deployment(settings, "lease", database_url=url, lease_seconds=6.0,
                             db_timeout=1.0, flush_every=0.2, retry_backoff=0.2,
                             retry_backoff_max=0.5)


@pytest.fixture(scope="module")
def client(own):
    return Client(own)


@pytest.fixture(scope="module")
def engine(own):
    return load_pair(get_preset("tiny"), own).engine(max_batch_size=4)


def _job(client, n=4):
    return client.submit([f"Fix: item {i} of {n}" for i in range(n)], pair="tiny",
                         enqueue=False, max_new_tokens=4, chunk_size=n)


def _owner(name: str) -> str:
    return f"{name}/1/{uuid.uuid4().hex[:8]}"


def _claim(sessions, job, owner: str, ttl: float) -> None:
    with sessions.begin() as s:
        assert chunks.claim(s, job_id=job.id, start=0, owner=owner, ttl=ttl) is not None


def _items(client, job):
    with client.sessions() as s:
        return s.execute(select(Item.index, Item.status, Item.launch, Item.attempts,
                                Item.crashes, Item.error)
                         .where(Item.job_id == job.id).order_by(Item.index)).all()


def _done(index: int) -> Outcome:
    return Outcome(index, ItemStatus.completed, output=f"out {index}", token_ids=[1, 2])


def test_a_superseded_runs_launch_marks_outcomes_and_faults_are_refused(client, own):
    job = _job(client)
    a, b = _owner("a"), _owner("b")
    _claim(client.sessions, job, a, ttl=60)
    keeper = ChunkKeeper(client.sessions, own, job.id, 0, 4, a).start()
    keeper.launch([0, 1], 1)  # a holds the lease: marked
    assert [r.launch for r in _items(client, job)][:2] == [f"{a}#1"] * 2
    with client.sessions.begin() as s:  # a's lease runs out; b takes the chunk over
        s.execute(update(Chunk).where(Chunk.job_id == job.id)
                  .values(lease_until=Chunk.lease_until - 3600))
    _claim(client.sessions, job, b, ttl=60)
    with client.sessions.begin() as s:
        repo.mark_launch(s, job_id=job.id, indices=[2], launch=f"{b}#1")
    with pytest.raises(Stopped):  # a's next batch: its marks are refused, and it stops
        keeper.launch([2, 3], 2)
    keeper.put(_done(0))
    keeper.failed([1], "RuntimeError: struck", 1)
    report = keeper.close()
    rows = _items(client, job)
    assert [r.status for r in rows] == [ItemStatus.pending.value] * 4  # nothing of a's stored
    assert [r.launch for r in rows] == [f"{a}#1", f"{a}#1", f"{b}#1", None]  # b's mark kept
    assert [(r.attempts, r.crashes) for r in rows] == [(0, 0)] * 4
    assert report.written == 0 and report.failures == 0
    assert report.refused == 2 + 1 + 1  # the two marks, the outcome, the fault
    assert keeper.lost.is_set()
    with client.sessions() as s:
        chunk = s.execute(select(Chunk).where(Chunk.job_id == job.id)).scalar_one()
        assert (chunk.lease_owner, chunk.faults) == (b, 0)  # a's release was b's no more


def test_a_stalled_run_gives_its_lease_up_before_a_takeover_which_charges_nothing(
        client, own, engine):
    """The run's database path stalls (every byte held) for longer than the lease: it
    gives up at two thirds of the lease, while the lease still holds, and says so on the
    broker; the run that takes the chunk over releases its items in flight, and the
    stalled run's writes after the stall are refused."""
    proxy = Proxy("127.0.0.1", 5432).start()
    try:
        via = make_url(own.database_url).set(port=proxy.port).render_as_string(
            hide_password=False)
        stalled = session_factory(via, own.db_timeout, hold=own.db_timeout)
        job = _job(client)
        a = _owner("a")
        lives = BrokerLives(own, "tiny")
        gave_up: list[tuple[str, float, int | None]] = []
        t0 = time.monotonic()
        _claim(stalled, job, a, ttl=own.lease_seconds)

        def give_up(owner: str) -> None:
            lives.record_give_up(owner)
            with client.sessions.begin() as s:  # the lease still holds: no one may claim
                runs = chunks.claim(s, job_id=job.id, start=0, owner=_owner("early"),
                                    ttl=60)
            gave_up.append((owner, time.monotonic() - t0, runs))

        keeper = ChunkKeeper(stalled, own, job.id, 0, 4, a, leased_at=t0,
                             on_give_up=give_up).start()
        keeper.launch([0, 1, 2, 3], 1)
        proxy.stall()
        keeper.put(_done(3))  # finished during the stall: kept, written after it
        wait_until(lambda: gave_up, 4 * own.lease_seconds, "the stalled run gave up")
        owner, after, runs = gave_up[0]
        assert owner == a and runs is None, gave_up  # given up while the lease held
        assert after < own.lease_seconds
        assert keeper.should_stop()
        # the lease runs out; another worker's run takes the chunk over, the stall goes on
        wait_until(lambda: _lease_out(client, job), 4 * own.lease_seconds, "lease out")
        report = run_chunk(sessions=client.sessions, engine=engine, pair="tiny",
                           job_id=job.id, start=0, end=4, hostname="b", settings=own,
                           lives=lives)
        assert (report.released, report.crashed, report.written) == (4, 0, 4), report
        proxy.restore()
        kept = keeper.close()  # the stalled run's outcome of item 3: refused
        assert kept.written == 0 and kept.refused >= 1
        rows = _items(client, job)
        assert all(r.status == ItemStatus.completed.value for r in rows)
        assert [(r.attempts, r.crashes, r.launch) for r in rows] == [(0, 0, None)] * 4
        with client.sessions() as s:
            assert s.scalar(select(Chunk.faults).where(Chunk.job_id == job.id)) == 0
    finally:
        proxy.close()


def _lease_out(client, job) -> bool:
    with client.sessions() as s:
        return bool(s.scalar(select(Chunk.lease_until < db_now())
                             .where(Chunk.job_id == job.id)))


def test_a_run_stopped_alive_releases_its_items_in_flight(client, own):
    """A run that stops (its lease given up, the job cancelled) clears its own launch
    marks as it gives the lease back: the next run finds none to charge."""
    job = _job(client)
    a = _owner("a")
    _claim(client.sessions, job, a, ttl=60)
    keeper = ChunkKeeper(client.sessions, own, job.id, 0, 4, a).start()
    keeper.launch([0, 1, 2], 1)
    assert [r.launch for r in _items(client, job)] == [f"{a}#1"] * 3 + [None]
    keeper.close()
    assert [r.launch for r in _items(client, job)] == [None] * 4
    with client.sessions() as s:
        assert repo.died_in_flight(s, job_id=job.id, start=0, end=4) == {}


def test_a_dead_runs_items_in_flight_are_charged_unless_it_gave_up(client, own, engine):
    job = _job(client)
    dead, alive = _owner("dead"), _owner("alive")
    with client.sessions.begin() as s:
        repo.mark_launch(s, job_id=job.id, indices=[0, 1], launch=f"{dead}#3")
        repo.mark_launch(s, job_id=job.id, indices=[2, 3], launch=f"{alive}#1")
    broker = redis.Redis.from_url(own.broker_url)
    presence.record_give_up(broker, own, alive)
    broker.close()
    report = run_chunk(sessions=client.sessions, engine=engine, pair="tiny", job_id=job.id,
                       start=0, end=4, hostname="b", settings=own, lives=BrokerLives(own, "tiny"))
    assert (report.crashed, report.released, report.written) == (2, 2, 4)
    rows = _items(client, job)
    assert [r.crashes for r in rows] == [1, 1, 0, 0]
    assert [r.attempts for r in rows] == [0, 0, 0, 0]  # two in the batch: no attempt


@pytest.mark.parametrize("case, charged", [
    ("announced", (1, 0)),  # its process may live: a crash, never an attempt
    ("not announced", (1, 1)),  # its worker's key lapsed: the death is proven
    ("restarted", (1, 1)),  # its hostname is announced by another process
    ("long ago", (1, 1)),  # announced, but its lease ran out over a lease ago
    ("broker away", (1, 0)),  # nothing proven where the broker cannot be read
])
def test_a_takeover_counts_an_attempt_only_for_a_proven_death(client, own, engine, case,
                                                               charged):
    """A run left one item alone in flight and its lease ran out: the run taking the chunk
    over counts the item a crash, and an attempt only where that run's death is proven."""
    job = _job(client)
    host = f"host-{uuid.uuid4().hex[:6]}"
    pid = os.getpid() + (1 if case == "restarted" else 0)
    dead = f"{host}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
    _claim(client.sessions, job, dead, ttl=60)
    lapse = 2 * own.lease_seconds if case == "long ago" else 0.1  # run out, and recent
    with client.sessions.begin() as s:
        s.execute(update(Chunk).where(Chunk.job_id == job.id)
                  .values(lease_until=db_now() - lapse))
        repo.mark_launch(s, job_id=job.id, indices=[0], launch=f"{dead}#2")
    broker = redis.Redis.from_url(own.broker_url)
    key = presence.worker_key(own, "tiny", host)
    if case not in ("not announced", "broker away"):
        broker.set(key, json.dumps({"pid": pid, "at": time.time()}), ex=120)
    away = own.model_copy(update={"broker_url": "redis://127.0.0.1:1/0", "broker_timeout": 1.0})
    try:
        report = run_chunk(sessions=client.sessions, engine=engine, pair="tiny",
                           job_id=job.id, start=0, end=4, hostname="b", settings=own,
                           lives=BrokerLives(away if case == "broker away" else own, "tiny"))
    finally:
        broker.delete(key)
        broker.close()
    assert (report.crashed, report.released, report.written) == (1, 0, 4)
    rows = _items(client, job)
    assert (rows[0].crashes, rows[0].attempts) == charged
    assert [(r.crashes, r.attempts) for r in rows[1:]] == [(0, 0)] * 3


def test_a_fault_record_the_database_refuses_is_dropped_and_the_outcomes_behind_it_written(
        client, own):
    job = _job(client)
    a = _owner("a")
    _claim(client.sessions, job, a, ttl=60)
    with client.sessions.begin() as s:  # the database refuses this one fault's text
        s.execute(text("""
            CREATE OR REPLACE FUNCTION refuse_fault() RETURNS trigger AS $$
            BEGIN RAISE EXCEPTION 'refused: %', NEW.error; END $$ LANGUAGE plpgsql"""))
        s.execute(text("""
            CREATE OR REPLACE TRIGGER refuse_fault BEFORE UPDATE ON items FOR EACH ROW
            WHEN (NEW.error LIKE '%refuse me%') EXECUTE FUNCTION refuse_fault()"""))
    try:
        keeper = ChunkKeeper(client.sessions, own, job.id, 0, 4, a).start()
        keeper.failed([1], "RuntimeError: refuse me", None)
        keeper.put(_done(0))
        keeper.failed([2], "RuntimeError: bad \x00 text \ud800 here", None)
        keeper.put(_done(3))
        done = threading.Event()
        closer = threading.Thread(target=lambda: (keeper.close(), done.set()), daemon=True)
        closer.start()
        assert done.wait(60), "the refused fault record held the keeper"
        report = keeper.report
    finally:
        with client.sessions.begin() as s:
            s.execute(text("DROP TRIGGER refuse_fault ON items"))
    rows = _items(client, job)
    assert [r.status for r in rows] == ["completed", "pending", "pending", "completed"]
    assert (report.written, report.dropped, report.failures) == (2, 1, 1)
    assert rows[1].attempts == 0 and rows[1].error is None  # the refused record: dropped
    assert rows[2].attempts == 1 and rows[2].error == "RuntimeError: bad \ufffd text \ufffd here"
