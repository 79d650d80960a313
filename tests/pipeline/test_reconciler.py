"""The reconciler against real Redis and PostgreSQL, in-process: what it re-sends, where
to, and what it leaves alone."""

from __future__ import annotations

import base64
import json

import redis
from kombu.transport.redis import PRIORITY_STEPS
from sqlalchemy import func, select, update

from specq.api.client import Client
from specq.broker.dispatch import queue_keys
from specq.broker.reconciler import reconcile
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import Chunk, Item, ItemStatus
from specq.db.outcomes import Outcome
from tests.conftest import live_leases, wait_until
from tests.pipeline.conftest import own_deployment, stored_unsent


def _key(queue: str, settings, step: int) -> str:
    """The Redis list of ``queue`` at priority ``step`` (behind the deployment's prefix)."""
    return dict(zip(PRIORITY_STEPS, queue_keys(queue, settings)))[step]


def _queued(r: redis.Redis, queue: str, settings) -> dict[int, list[int]]:
    """Chunk starts waiting on each priority list of ``queue``."""
    out = {}
    for step in PRIORITY_STEPS:
        out[step] = sorted(json.loads(base64.b64decode(json.loads(m)["body"]))[0][1]
                           for m in r.lrange(_key(queue, settings, step), 0, -1))
    return {k: v for k, v in out.items() if v}


def test_lost_chunks_are_sent_again_a_dead_workers_first(settings):
    own = own_deployment(settings, "rec", reconcile_grace=0.0)
    client = Client(own)
    job = client.submit([f"reconcile me {i}" for i in range(30)], pair="tiny-lookup",
                        max_new_tokens=4, chunk_size=10)
    queue = f"{own.queue_prefix}.tiny-lookup"
    r = redis.Redis.from_url(own.broker_url)
    assert _queued(r, queue, own) == {6: [0, 10, 20]}
    report = reconcile(own, job_id=job.id)
    assert (report.candidates, report.on_broker, len(report.resent)) == (3, 3, 0)

    with client.sessions.begin() as s:  # a worker took chunk 0, then died
        assert chunks.claim(s, job_id=job.id, start=0, owner="dead", ttl=0.2) == 1
    r.delete(*queue_keys(queue, own))  # and the broker lost every message

    def lease_ran_out() -> bool:
        with client.sessions() as s:
            return live_leases(s, job_id=job.id) == []

    wait_until(lease_ran_out, 10, "the dead worker's lease running out")
    report = reconcile(own, job_id=job.id)
    assert sorted((c.start, c.started) for c in report.resent) == [
        (0, True), (10, False), (20, False)]
    assert _queued(r, queue, own) == {0: [0], 6: [10, 20]}  # the dead worker's chunk goes first
    assert len(reconcile(own, job_id=job.id).resent) == 0  # all on the broker again

    with client.sessions.begin() as s:  # a live lease is left alone, messages or not
        assert chunks.claim(s, job_id=job.id, start=10, owner="alive", ttl=60) == 1
    r.delete(*queue_keys(queue, own))
    assert [c.start for c in reconcile(own, job_id=job.id).resent] == [0, 20]
    r.close()
    client.job(job.id).cancel()


def test_a_job_whose_last_writer_died_before_settling_is_ended(settings):
    """Its own deployment's reconciler ends it; another's, on the same database, leaves
    it (the session's workers reconcile too: a job of no queue would be theirs as well)."""
    own = own_deployment(settings, "rec")
    client = Client(own)
    job = client.submit(["settle me"], pair="tiny-lookup", max_new_tokens=4)
    with client.sessions.begin() as s:
        repo.start_job(s, job_id=job.id)
        repo.write_outcomes(s, job_id=job.id, outcomes=[
            Outcome(0, ItemStatus.completed, output="o", token_ids=[1], worker="w")])
    assert job.id not in reconcile(own_deployment(settings, "other")).settled
    assert job.status(check_workers=False).status == "in_progress"
    assert reconcile(own).settled.get(job.id) == "completed"
    assert job.status(check_workers=False).status == "completed"


def test_a_job_run_in_process_is_no_reconcilers_to_send(settings):
    """`specq run` stores its job without a queue: a fleet's reconciler on the same
    database neither sends its chunks nor counts them lost."""
    own = own_deployment(settings, "rec", reconcile_grace=0.0)
    client = Client(own)
    job = client.submit(["in process 0", "in process 1"], pair="tiny-lookup",
                        max_new_tokens=4, chunk_size=1, enqueue=False)
    with client.sessions() as s:
        assert repo.get_job(s, job_id=job.id).queue is None
    report = reconcile(own)
    touched = [c for c in report.resent + report.fed + report.abandoned if c.job_id == job.id]
    assert touched == [] and job.id not in report.settled
    with client.sessions() as s:
        assert chunks.unsent_jobs(s, job_id=job.id) == []  # nothing waits to be sent
    client.job(job.id).cancel()


def test_a_job_keeps_its_turn_on_the_queue(settings):
    """Only dispatch_window chunks of a job wait on the broker; the reconciler sends the
    next ones when fewer wait (a producer that died before sending, a flushed broker)."""
    own = own_deployment(settings, "rec", dispatch_window=2, reconcile_grace=60.0)
    client = Client(own)
    queue = f"{own.queue_prefix}.tiny-lookup"
    r = redis.Redis.from_url(own.broker_url)
    job = stored_unsent(client, [f"turn {i}" for i in range(50)], pair="tiny-lookup",
                        max_new_tokens=4, chunk_size=10)  # the producer died
    assert _queued(r, queue, own) == {}
    report = reconcile(own, job_id=job.id)
    assert [c.start for c in report.fed] == [0, 10] and _queued(r, queue, own) == {6: [0, 10]}
    assert reconcile(own, job_id=job.id).fed == []  # its turn is on the queue
    with client.sessions.begin() as s:  # a worker took chunk 0's message (the oldest)
        chunks.claim(s, job_id=job.id, start=0, owner="w", ttl=60)
    r.rpop(_key(queue, own, 6))  # and died before it could send the next
    assert [c.start for c in reconcile(own, job_id=job.id).fed] == [20]
    urgent = client.submit(["urgent"], pair="tiny-lookup", max_new_tokens=4,
                           priority="high")
    assert _queued(r, queue, own)[3] == [0]  # sent at once, on the high-priority list
    r.close()
    client.job(job.id).cancel()
    client.job(urgent.id).cancel()


def test_chunks_marked_sent_but_not_yet_published_hold_their_turn(settings):
    """A producer commits its job's first turn as sent, then publishes: a reconciler pass
    between the two must not fill the turn again (twice the window on the queue)."""
    own = own_deployment(settings, "rec", dispatch_window=2, reconcile_grace=60.0)
    client = Client(own)
    queue = f"{own.queue_prefix}.tiny-lookup"
    r = redis.Redis.from_url(own.broker_url)
    job = stored_unsent(client, [f"gap {i}" for i in range(50)], pair="tiny-lookup",
                        max_new_tokens=4, chunk_size=10)
    with client.sessions.begin() as s:  # the producer's commit; its publish not yet made
        assert [c.start for c in chunks.take_unsent(s, job_id=job.id, n=2)] == [0, 10]
    assert reconcile(own, job_id=job.id).fed == [] and _queued(r, queue, own) == {}
    with client.sessions.begin() as s:  # past the grace, unpublished: lost, sent again
        s.execute(update(Chunk).where(Chunk.job_id == job.id, Chunk.start.in_([0, 10]))
                  .values(sent_at=Chunk.sent_at - 120))  # (epoch seconds)
    report = reconcile(own, job_id=job.id)
    assert [c.start for c in report.resent] == [0, 10] and report.fed == []
    assert _queued(r, queue, own) == {6: [0, 10]}
    r.close()
    client.job(job.id).cancel()


def test_a_chunk_sent_max_chunk_runs_times_fails_with_its_jobs_error(settings):
    """Messages that vanish without a lease (a worker that fails the chunk before its items
    reach the engine) count: after max_chunk_runs sends the chunk is not sent again, its
    items fail with the error the job keeps, and a retry gives it max_chunk_runs more."""
    own = own_deployment(settings, "rec", reconcile_grace=0.0, max_chunk_runs=3)
    client = Client(own)
    job = client.submit([f"lost {i}" for i in range(3)], pair="tiny-lookup",
                        max_new_tokens=4, chunk_size=10)
    queue = f"{own.queue_prefix}.tiny-lookup"
    r = redis.Redis.from_url(own.broker_url)
    with client.sessions.begin() as s:
        repo.note_job_error(s, job_id=job.id, error="chunk [0, 3) failed on worker w: boom")
    state = job.status(check_workers=False)
    assert state.error.endswith("boom") and "SPECQ_MAX_CHUNK_RUNS" in state.note
    for _ in range(2):  # a worker takes the message and fails before any lease: lost
        r.delete(*queue_keys(queue, own))
        report = reconcile(own, job_id=job.id)
        assert [c.start for c in report.resent] == [0] and report.abandoned == []
    r.delete(*queue_keys(queue, own))
    report = reconcile(own, job_id=job.id)
    assert [c.start for c in report.abandoned] == [0] and report.resent == []
    assert report.settled[job.id] == "completed" and _queued(r, queue, own) == {}
    state = job.status(check_workers=False)
    assert (state.failed, state.pending) == (3, 0)
    assert {it.error for it in job.results()} == {
        "chunk abandoned: sent 3 times and never finished (SPECQ_MAX_CHUNK_RUNS); last "
        "failure: chunk [0, 3) failed on worker w: boom"}

    assert job.retry() == [0, 1, 2]  # fixed: the chunk starts its count again
    assert _queued(r, queue, own) == {6: [0]}
    assert reconcile(own, job_id=job.id).abandoned == []
    r.close()
    client.job(job.id).cancel()


def test_messages_the_broker_alone_loses_fail_nothing(settings):
    """A chunk no worker ever saw (no lease, no failure kept on its job) whose messages the
    broker loses again and again (flushed, restarted empty) is sent again every time, past
    max_chunk_runs sends: nothing fails for the broker's losses."""
    own = own_deployment(settings, "rec", reconcile_grace=0.0, max_chunk_runs=2)
    client = Client(own)
    job = client.submit([f"flushed {i}" for i in range(3)], pair="tiny-lookup",
                        max_new_tokens=4, chunk_size=10)
    queue = f"{own.queue_prefix}.tiny-lookup"
    r = redis.Redis.from_url(own.broker_url)
    for _ in range(5):
        r.delete(*queue_keys(queue, own))
        report = reconcile(own, job_id=job.id)
        assert [c.start for c in report.resent] == [0] and report.abandoned == []
    state = job.status(check_workers=False)
    assert (state.failed, state.pending) == (0, 3)
    assert _queued(r, queue, own) != {}
    r.close()
    client.job(job.id).cancel()


def test_a_deployment_reconciles_its_own_jobs_only(settings):
    """Two deployments on one database and one Redis database, their keys behind their own
    prefixes: the reconciler of one cannot see the other's messages, so it leaves the other's
    jobs alone (it would send their chunks where no worker of theirs looks)."""
    mine, theirs = (own_deployment(settings, "rec", reconcile_grace=0.0, dispatch_window=1)
                    for _ in range(2))
    job = Client(theirs).submit([f"theirs {i}" for i in range(20)], pair="tiny-lookup",
                                max_new_tokens=4, chunk_size=10)
    r = redis.Redis.from_url(theirs.broker_url)
    queue = f"{theirs.queue_prefix}.tiny-lookup"
    assert _queued(r, queue, theirs) == {6: [0]}
    report = reconcile(mine)  # sees none of their messages, and must not think them lost
    assert job.id not in {c.job_id for c in report.resent + report.fed + report.abandoned}
    assert report.candidates == 0
    r.delete(*queue_keys(queue, theirs))  # their broker lost the message: theirs re-send it
    assert [c.start for c in reconcile(theirs, job_id=job.id).resent] == [0]
    assert _queued(r, queue, theirs) == {6: [0]}
    r.close()
    job.cancel()


def test_the_fleet_reconciles_once_a_period_under_load(settings):
    """Two workers' reconciler threads beside two CPU-burning processes: the deployment's
    passes, idle ones included, come once a period (the Redis lock keeps them from coming
    twice). The bounds are loose below (a loaded machine delays a tick and slows a pass;
    before, idle passes were not counted at all) and exact above."""
    import multiprocessing
    import time

    from specq.broker.reconciler import Background, read_actions

    own = own_deployment(settings, "period", reconcile_every=0.5)
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(2)]
    for b in burners:
        b.start()
    threads = [Background(own).start() for _ in range(2)]
    try:
        t0 = time.monotonic()
        time.sleep(6.0)
        for t in threads:
            t.stop()
        elapsed = time.monotonic() - t0
        for t in threads:
            t.thread.join(timeout=30)
    finally:
        for b in burners:
            b.terminate()
    r = redis.Redis.from_url(own.broker_url)
    try:
        runs = read_actions(r, own)["runs"]
    finally:
        r.close()
    periods = elapsed / own.reconcile_every
    assert periods / 8 <= runs <= periods / 0.9 + 2, (runs, elapsed)


def _burn() -> None:
    import os

    os.nice(10)  # it loads this test's threads; the other test processes' leases are short
    while True:
        sum(i * i for i in range(10_000))


def test_a_cancel_ends_without_a_worker_and_a_live_lease_is_left_to_its_run(settings):
    """A job cancelled while its workers are dead (or none serves its pair): the chunks no
    live lease holds (waiting on the broker, or their worker's lease run out) are cancelled
    by the reconciler, never sent again, and the job ends cancelled; a chunk under a live
    lease is its run's to cancel, and is left alone until that lease runs out."""
    own = own_deployment(settings, "reccancel", reconcile_grace=0.0)
    client = Client(own)
    job = client.submit([f"cancel me {i}" for i in range(40)], pair="tiny-lookup",
                        max_new_tokens=4, chunk_size=10)
    with client.sessions.begin() as s:  # a worker took chunk 0 and died; one runs 10
        repo.start_job(s, job_id=job.id)
        assert chunks.claim(s, job_id=job.id, start=0, owner="dead", ttl=0.2) == 1
        assert chunks.claim(s, job_id=job.id, start=10, owner="alive", ttl=3600) == 1
        s.execute(update(Item).where(Item.job_id == job.id, Item.index < 3)
                  .values(launch="dead/1#1"))
    assert client.job(job.id).cancel().status == "cancelling"

    def dead_lease_ran_out() -> bool:
        with client.sessions() as s:
            return "dead" not in [o for _, _, o in live_leases(s, job_id=job.id)]

    wait_until(dead_lease_ran_out, 10, "the dead worker's lease running out")
    report = reconcile(own, job_id=job.id)
    assert report.resent == [] and report.cancelled == 30  # 0, 20, 30: not 10 (alive)
    state = job.status(check_workers=False)
    assert (state.status, state.cancelled, state.pending) == ("cancelling", 30, 10)
    with client.sessions.begin() as s:  # its worker dies too: its lease runs out
        s.execute(update(Chunk).where(Chunk.job_id == job.id, Chunk.start == 10)
                  .values(lease_until=0.0))
    report = reconcile(own, job_id=job.id)
    assert report.cancelled == 10 and report.settled[job.id] == "cancelled"
    with client.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Item).where(
            Item.job_id == job.id, Item.launch.is_not(None))) == 0
        assert s.scalar(select(func.count()).select_from(Item).where(
            Item.job_id == job.id, Item.status != ItemStatus.cancelled.value)) == 0
