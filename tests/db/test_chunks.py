"""Chunks on SQLite and PostgreSQL: leases on the database's clock, what the reconciler
may re-send, attempts and retries of items."""

from __future__ import annotations

import time

from sqlalchemy import select

from specq.db import chunks
from specq.db import repository as repo
from specq.db.clock import db_now
from specq.db.models import Chunk, Item, ItemStatus, JobStatus
from specq.db.outcomes import Outcome
from specq.schema.counters import Counters
from tests.conftest import live_leases, wait_until
from tests.db.conftest import queued_job as _job


def test_the_database_clock_is_seconds_since_the_epoch(sessions):
    with sessions() as s:
        assert abs(s.scalar(select(db_now())) - time.time()) < 5


def test_chunks_cover_the_job(sessions):
    job_id = _job(sessions, n=10, chunk_size=4)
    with sessions() as s:
        rows = s.execute(select(Chunk.start, Chunk.end, Chunk.done)
                         .where(Chunk.job_id == job_id).order_by(Chunk.start)).all()
    assert [tuple(r) for r in rows] == [(0, 4, False), (4, 8, False), (8, 10, False)]


def test_a_lease_is_held_until_it_runs_out(sessions):
    job_id = _job(sessions)
    with sessions.begin() as s:
        # 2 s: the lease runs out on the database's own clock, and this process may pause
        assert chunks.claim(s, job_id=job_id, start=0, owner="a", ttl=2) == 1
        assert chunks.claim(s, job_id=job_id, start=0, owner="b", ttl=2) is None
        assert chunks.renew(s, job_id=job_id, start=0, owner="a", ttl=2)
        assert not chunks.renew(s, job_id=job_id, start=0, owner="b", ttl=2)
        assert [(j, st, o) for j, st, o in live_leases(s, job_id=job_id)] == [
            (job_id, 0, "a")]

    def ran_out() -> bool:
        with sessions() as s:
            return live_leases(s, job_id=job_id) == []

    wait_until(ran_out, 10, "the lease running out")
    with sessions.begin() as s:
        assert chunks.claim(s, job_id=job_id, start=0, owner="b", ttl=5) == 2  # taken over
        assert not chunks.renew(s, job_id=job_id, start=0, owner="a", ttl=5)  # a lost it


# a grace under which every sent chunk counts however recent: the database clock ticks in
# milliseconds, and with a grace of 0 a chunk sent in the same tick as the query did not count
ANY_AGE = -1.0


def test_the_reconciler_sees_only_unleased_unfinished_chunks_sent_long_ago(sessions):
    job_id = _job(sessions, n=12, chunk_size=4)
    with sessions() as s:
        assert chunks.unclaimed(s, grace=0, job_id=job_id) == []  # none sent
    with sessions.begin() as s:
        assert len(chunks.take_unsent(s, job_id=job_id, n=5)) == 3
    with sessions() as s:
        assert chunks.unclaimed(s, grace=60, job_id=job_id) == []  # just sent
        assert [c.start for c in chunks.unclaimed(s, grace=ANY_AGE, job_id=job_id)] == [0, 4, 8]
    with sessions.begin() as s:
        chunks.claim(s, job_id=job_id, start=0, owner="a", ttl=60)
        repo.write_outcomes(s, job_id=job_id, outcomes=[_done(i) for i in range(4, 8)])
        chunks.claim(s, job_id=job_id, start=4, owner="b", ttl=60)
        assert chunks.release(s, job_id=job_id, start=4, end=8, owner="b")  # done
    with sessions() as s:
        left = chunks.unclaimed(s, grace=ANY_AGE, job_id=job_id)
    assert [(c.start, c.end, c.queue) for c in left] == [(8, 12, "q.tiny")]
    with sessions.begin() as s:
        chunks.mark_sent(s, refs=left)
    with sessions() as s:
        assert chunks.unclaimed(s, grace=60, job_id=job_id) == []
        assert s.get(Chunk, (job_id, 8)).sends == 2  # first sent, then re-sent


def test_a_jobs_chunks_are_sent_in_turns_in_item_order(sessions):
    job_id = _job(sessions, n=20, chunk_size=4)  # chunks 0 4 8 12 16
    with sessions() as s:
        assert chunks.unsent_jobs(s, job_id=job_id) == [job_id]
    with sessions.begin() as s:
        first = chunks.take_unsent(s, job_id=job_id, n=2)
    assert [(r.job_id, r.start, r.end, r.queue, r.priority) for r in first] == [
        (job_id, 0, 4, "q.tiny", "normal"), (job_id, 4, 8, "q.tiny", "normal")]
    with sessions.begin() as s:
        nxt = chunks.take_unsent(s, job_id=job_id, n=1)
        chunks.unsend(s, refs=nxt)  # its message could not be sent: it waits again
    with sessions.begin() as s:
        assert [r.start for r in chunks.take_unsent(s, job_id=job_id, n=2)] == [8, 12]
        assert s.get(Chunk, (job_id, 8)).sends == 1
        chunks.mark_done(s, job_id=job_id, start=16)  # done chunks are never sent
        assert chunks.take_unsent(s, job_id=job_id, n=2) == []
    with sessions() as s:
        assert chunks.unsent_jobs(s, job_id=job_id) == []


def test_cancelling_a_running_job_cancels_the_items_of_its_unsent_chunks(sessions):
    job_id = _job(sessions, n=10, chunk_size=4)  # chunks 0 4 8
    with sessions.begin() as s:
        chunks.take_unsent(s, job_id=job_id, n=1)
        repo.start_job(s, job_id=job_id)
        assert repo.request_cancel(s, job_id=job_id) == JobStatus.cancelling
    with sessions() as s:
        status = dict(s.execute(select(Item.index, Item.status).where(Item.job_id == job_id)).all())
        assert [status[i] for i in range(10)] == ["pending"] * 4 + ["cancelled"] * 6
        assert [s.get(Chunk, (job_id, c)).done for c in (0, 4, 8)] == [False, True, True]
        assert chunks.unsent_jobs(s, job_id=job_id) == []


def test_failures_count_attempts_and_retry_keeps_them(sessions):
    job_id = _job(sessions, n=4, chunk_size=4)
    with sessions.begin() as s:
        assert repo.record_failures(s, job_id=job_id, start=0, indices=[1, 2],
                                    error="boom") == 2
        repo.write_outcomes(s, job_id=job_id, outcomes=[
            _done(0), Outcome.failure(1, "boom"), _done(2), _done(3)])
        repo.lock_job(s, job_id=job_id)
        assert repo.settle_job(s, job_id=job_id) == JobStatus.completed
    with sessions.begin() as s:
        assert repo.retry_failed(s, job_id=job_id) == [1]
        refs = chunks.reopen(s, job_id=job_id, indices=[1])
    assert [(r.start, r.end) for r in refs] == [(0, 4)]
    with sessions() as s:
        item = s.get(Item, (job_id, 1))
        job = repo.get_job(s, job_id=job_id)
        assert (item.status, item.attempts, item.retries, item.writes) == ("pending", 1, 1, 0)
        assert job.status == JobStatus.queued.value and job.finished_at is None
        assert s.get(Chunk, (job_id, 0)).done is False
        assert job_id not in repo.unsettled_jobs(s)  # (other tests share the database)
    with sessions.begin() as s:
        repo.write_outcomes(s, job_id=job_id, outcomes=[_done(1)])
    with sessions() as s:
        assert job_id in repo.unsettled_jobs(s)  # none pending, not yet ended


def test_a_deployment_settles_its_own_jobs_and_those_run_in_a_process(sessions):
    """The reconciler of the deployment whose queues are named PREFIX.PAIR ends its own
    jobs and those with no queue (run in a process of their own), never another's."""
    ids = {queue: _job(sessions, n=2, chunk_size=2, queue=queue)
           for queue in ("fleet.tiny", "fleet-b.tiny", "fleetx.tiny", None)}
    with sessions.begin() as s:
        for job_id in ids.values():
            repo.start_job(s, job_id=job_id)
            repo.write_outcomes(s, job_id=job_id, outcomes=[_done(0), _done(1)])
    with sessions() as s:
        assert set(repo.unsettled_jobs(s, queue_prefix="fleet")) & set(ids.values()) == {
            ids["fleet.tiny"], ids[None]}
        assert repo.unsettled_jobs(s, queue_prefix="fleet-b", job_id=ids["fleet.tiny"]) == []
        assert repo.unsettled_jobs(s, queue_prefix="fleet-b", job_id=ids["fleet-b.tiny"]) == [
            ids["fleet-b.tiny"]]


def _done(i):
    return Outcome(i, ItemStatus.completed, output="o", token_ids=[1],
                   finish_reason="length", prompt_tokens=1, counters=Counters(), worker="w")


def test_two_workers_writing_a_jobs_last_items_at_once_end_it(db_url, sessions):
    """No lock: each settles after its writes committed, and the later one sees both."""
    import threading

    for _ in range(15):
        job_id = _job(sessions, n=2, chunk_size=1)
        with sessions.begin() as s:
            repo.start_job(s, job_id=job_id)
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=_finish, args=(sessions, job_id, i, barrier))
                   for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with sessions() as s:
            assert repo.get_job(s, job_id=job_id).status == JobStatus.completed.value


def _finish(sessions, job_id: int, index: int, barrier) -> None:
    """A worker's last write of a job, then its settling, in two transactions."""
    barrier.wait()
    with sessions.begin() as s:
        repo.write_outcomes(s, job_id=job_id, outcomes=[_done(index)])
    with sessions.begin() as s:
        repo.settle_job(s, job_id=job_id)


def test_chunk_counts_follow_every_change_of_their_items(sessions):
    """status_counts adds up the chunks' counts: after writes, failures, a retry, a chunk
    cancelled while running and the unsent rest of a cancelled job, they equal a count of
    the items themselves."""
    job_id = _job(sessions, n=12, chunk_size=4)  # chunks 0 4 8

    def same() -> dict:
        with sessions() as s:
            counted = repo.count_items(s, job_id=job_id)
            assert repo.status_counts(s, job_id=job_id) == counted
            return counted

    with sessions.begin() as s:
        chunks.take_unsent(s, job_id=job_id, n=2)
        repo.start_job(s, job_id=job_id)
        repo.write_outcomes(s, job_id=job_id, outcomes=[_done(0), _done(1), _done(4)])
        repo.write_outcomes(s, job_id=job_id, outcomes=[
            Outcome.failure(2, "boom", counters=Counters(new_tokens=2)),
            Outcome.failure(3, "never ran")])
        repo.write_outcomes(s, job_id=job_id, outcomes=[_done(1)])  # written once only
    assert same() == {"pending": 7, "completed": 3, "failed": 2, "cancelled": 0}
    with sessions.begin() as s:
        assert repo.retry_failed(s, job_id=job_id) == [2, 3]
    assert same()["failed"] == 0
    with sessions.begin() as s:
        chunk = s.get(Chunk, (job_id, 0))
        assert (chunk.new_tokens, chunk.completed) == (0, 2)  # the retried item's 2 are gone
        assert repo.request_cancel(s, job_id=job_id) == JobStatus.cancelling  # [8, 12) unsent
        repo.cancel_pending(s, job_id=job_id, start=4, end=8)  # a worker's chunk
    assert same() == {"pending": 2, "completed": 3, "failed": 0, "cancelled": 7}


def test_launch_marks_tell_the_next_run_who_was_in_flight_when_a_worker_died(sessions):
    """Marks outlive a dead worker: the next run finds each batch that was in flight. Items
    of a batch count a crash; one alone counts an attempt too; the chunk counts the faults,
    keeps the first error, and outcome writes clear the marks."""
    job_id = _job(sessions, n=8, chunk_size=8)
    with sessions.begin() as s:
        repo.mark_launch(s, job_id=job_id, indices=[0, 1, 2], launch="w1#1")
        repo.mark_launch(s, job_id=job_id, indices=[3], launch="w1#2")
        repo.mark_launch(s, job_id=job_id, indices=[4], launch="w1#3")
        repo.write_outcomes(s, job_id=job_id, outcomes=[_done(4)])  # finished: not in flight
    with sessions.begin() as s:
        died = repo.died_in_flight(s, job_id=job_id, start=0, end=8)
        assert died == {"w1#1": [0, 1, 2], "w1#2": [3]}
        assert repo.record_crash(s, job_id=job_id, start=0, indices=died["w1#1"],
                                 why="killed") == [(0, 1, 0), (1, 1, 0), (2, 1, 0)]
        assert repo.record_crash(s, job_id=job_id, start=0, indices=died["w1#2"],
                                 why="segfault") == [(3, 1, 1)]
        assert repo.died_in_flight(s, job_id=job_id, start=0, end=8) == {}
    with sessions() as s:
        three, one = s.get(Item, (job_id, 3)), s.get(Item, (job_id, 0))
        assert three.error == ("killed or crashed its worker 1 time (last alone in its batch: "
                               "segfault)")
        assert "with 2 others in its batch" in one.error
        chunk = s.get(Chunk, (job_id, 0))
        assert chunk.faults == 2
        assert chunk.first_fault == "worker died with items [0, 1, 2] in flight: killed"


def test_a_launch_clears_the_marks_of_items_finished_but_not_written(sessions):
    """One statement marks the batch that starts and clears the marks of the items that
    finished before it (their outcomes still queued): a death in the new batch blames the
    items in flight only, and nothing is written by the mark."""
    job_id = _job(sessions, n=6, chunk_size=6)
    with sessions.begin() as s:
        repo.mark_launch(s, job_id=job_id, indices=[0, 1, 2], launch="w#1")
        repo.write_outcomes(s, job_id=job_id, outcomes=[_done(2)])  # written: no mark
    with sessions.begin() as s:
        repo.mark_launch(s, job_id=job_id, indices=[3, 4], launch="w#1", finished=[0, 2])
    with sessions() as s:
        items = [s.get(Item, (job_id, i)) for i in range(6)]
        assert [it.launch for it in items] == [None, "w#1", None, "w#1", "w#1", None]
        assert [it.status for it in items] == ["pending"] * 2 + ["completed"] + ["pending"] * 3
        assert repo.died_in_flight(s, job_id=job_id, start=0, end=6) == {"w#1": [1, 3, 4]}


def _launches(sessions, job_id, n):
    with sessions() as s:
        return [s.get(Item, (job_id, i)).launch for i in range(n)]


def test_a_launch_marks_only_under_a_live_lease_of_its_run(sessions):
    """mark_launch_held marks (and clears the finished items' marks) only for the run that
    holds a live lease on the chunk: a superseded owner, an owner whose lease ran out and
    a chunk nobody holds are refused, and nothing is written for them."""
    job_id = _job(sessions, n=6, chunk_size=6)
    marks = dict(job_id=job_id, start=0)
    with sessions.begin() as s:
        assert not repo.mark_launch_held(s, **marks, owner="a", indices=[0], launch="a#1")
        assert chunks.claim(s, job_id=job_id, start=0, owner="a", ttl=60) == 1
        assert repo.mark_launch_held(s, **marks, owner="a", indices=[0, 1, 2], launch="a#1")
        assert repo.write_outcomes(s, job_id=job_id, outcomes=[_done(2)]) == 1
    with sessions.begin() as s:  # finished 0 (queued), 2 (written); 3 and 4 start
        assert repo.mark_launch_held(s, **marks, owner="a", indices=[3, 4], launch="a#2",
                                     finished=[0, 2])
        assert not repo.mark_launch_held(s, **marks, owner="b", indices=[5], launch="b#1",
                                         finished=[1])
    assert _launches(sessions, job_id, 6) == [None, "a#1", None, "a#2", "a#2", None]
    with sessions.begin() as s:  # a's lease runs out: still a's, but not live
        s.execute(Chunk.__table__.update().where(Chunk.job_id == job_id)
                  .values(lease_until=db_now() - 1))
        assert chunks.holds(s, job_id=job_id, start=0, owner="a")
        assert not repo.mark_launch_held(s, **marks, owner="a", indices=[5], launch="a#3",
                                         finished=[1, 3])
    assert _launches(sessions, job_id, 6) == [None, "a#1", None, "a#2", "a#2", None]
    with sessions.begin() as s:  # b takes the chunk over: a is superseded
        assert chunks.claim(s, job_id=job_id, start=0, owner="b", ttl=60) == 2
        assert not repo.mark_launch_held(s, **marks, owner="a", indices=[5], launch="a#3")
        assert repo.mark_launch_held(s, **marks, owner="b", indices=[5], launch="b#1",
                                     finished=[3])
        assert repo.mark_launch_held(s, **marks, owner="b", indices=[], launch="b#2")
    assert _launches(sessions, job_id, 6) == [None, "a#1", None, None, "a#2", "b#1"]


def test_an_exception_clears_its_own_launch_mark_only(sessions):
    """A failure recorded after the item was launched again keeps the newer mark."""
    job_id = _job(sessions, n=2, chunk_size=2)
    with sessions.begin() as s:
        repo.mark_launch(s, job_id=job_id, indices=[0, 1], launch="w#1")
        repo.mark_launch(s, job_id=job_id, indices=[1], launch="w#2")  # alone, again
        repo.record_failures(s, job_id=job_id, start=0, indices=[0, 1], error="boom",
                             launch="w#1")
    with sessions() as s:
        assert [s.get(Item, (job_id, i)).launch for i in (0, 1)] == [None, "w#2"]
        assert s.get(Chunk, (job_id, 0)).faults == 1


def test_cancelling_a_running_job_waits_for_no_running_chunk(pg_url):
    """A worker giving its lease back locks its chunk, then the job (settling it); a cancel
    locks the job, then the chunks whose items it cancels: only those not sent yet, never a
    running one, so the two cannot deadlock."""
    from sqlalchemy import text

    from specq.db.session import migrate, session_factory

    migrate(pg_url)
    sessions = session_factory(pg_url)
    job_id = _job(sessions, n=8, chunk_size=4)
    with sessions.begin() as s:
        assert [r.start for r in chunks.take_unsent(s, job_id=job_id, n=1)] == [0]
        chunks.claim(s, job_id=job_id, start=0, owner="w", ttl=60)
        repo.start_job(s, job_id=job_id)
    worker = sessions()
    worker.begin()
    chunks.release(worker, job_id=job_id, start=0, end=4, owner="w")  # chunk 0's row: locked
    with sessions.begin() as s:
        s.execute(text("SET LOCAL lock_timeout = '10s'"))  # a wait on chunk 0 fails, not hangs
        assert repo.request_cancel(s, job_id=job_id) == JobStatus.cancelling
    repo.settle_job(worker, job_id=job_id)
    worker.commit()
    worker.close()
    with sessions() as s:
        counts = dict(s.execute(select(Chunk.start, Chunk.cancelled)
                                .where(Chunk.job_id == job_id)).all())
    assert counts == {0: 0, 4: 4}
