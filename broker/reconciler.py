"""The reconciler: the database is the truth, the broker is rebuilt from it.

A chunk of an unfinished job that is not done, that no live lease holds, that was last
sent more than ``reconcile_grace`` seconds ago and whose message is not on the broker (nor
just delivered to a worker) is sent again. That one rule covers a flushed or restarted
broker, a producer killed between storing a job and sending it, a submission made while
the broker was down, a worker killed mid-chunk (its lease runs out within
``lease_seconds``), and a task that gave up on a long database outage. Re-sending is
always safe: a worker claims a chunk's lease before running it and writes each item once.
A chunk sent ``max_chunk_runs`` times that is lost again is not sent once more when
workers saw it fail (`given_up`): its pending items fail, with the reason its job keeps (a
chunk that fails on every worker before its items reach the engine, say, whose messages
vanish without a lease). Messages the broker alone lost are sent again however many times.
It also ends jobs none of whose items is pending (their last writer died before it could):
its own deployment's, and those run in a process of their own. And it keeps every
unfinished job's turn on its queue: a job with chunks not sent yet and fewer than
``dispatch_window`` messages on the broker gets its next chunks sent (a producer that died
before sending any, a submission while the broker was down, a flushed broker).
A chunk sent within ``reconcile_grace`` counts as waiting even before the broker shows its
message: a producer publishes after its commit, and filling that gap would put twice the
window on the queue.

It runs in every worker (a thread; one run per ``reconcile_every`` seconds fleet-wide,
under a Redis lock), in the beat process, and by hand: `specq reconcile [JOB]`. It sends
the chunks of its own deployment's jobs only (queues named ``queue_prefix``.PAIR): every
key on the broker is behind that prefix, so another deployment's messages are out of its
sight, and sending that deployment's chunks would put them where its workers never look.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import redis
from celery import Celery
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from specq.broker import connection, dispatch
from specq.broker.names import PRIORITY_RESENT
from specq.configs.settings import Settings
from specq.db import chunks
from specq.db import repository as repo
from specq.db.chunks import ChunkRef
from specq.db.models import RUNNING, Job, JobStatus
from specq.db.outcomes import Outcome
from specq.db.session import session_factory

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    candidates: int = 0  # chunks not done, not leased, not sent recently
    on_broker: int = 0  # of those, still held by the broker
    resent: list[ChunkRef] = field(default_factory=list)
    abandoned: list[ChunkRef] = field(default_factory=list)  # sent max_chunk_runs times
    fed: list[ChunkRef] = field(default_factory=list)  # first sends, to fill a job's window
    settled: dict[int, str] = field(default_factory=dict)  # job id -> status it ended in
    cancelled: int = 0  # items of cancelling jobs' unleased chunks, cancelled here
    broker_read: bool = False  # it read the broker (there were queues to look at)

    def as_dict(self) -> dict[str, Any]:
        by_job: dict[int, int] = {}
        for r in self.resent:
            by_job[r.job_id] = by_job.get(r.job_id, 0) + 1
        return {"candidates": self.candidates, "on_broker": self.on_broker,
                "resent": len(self.resent), "resent_by_job": by_job, "fed": len(self.fed),
                "abandoned": len(self.abandoned), "settled": self.settled,
                "cancelled": self.cancelled}


# What the reconcilers of a deployment did, added up on the broker (a Redis hash), where
# the exporter reads it (api/exporter.py): runs, chunks re-sent, jobs settled, chunks sent
# to fill a job's turns (refilled), chunks abandoned, runs the database failed.
ACTIONS = ("runs", "resent", "settled", "refilled", "abandoned", "database_errors")


def actions_key(settings: Settings) -> str:
    return f"{settings.queue_prefix}:reconciler-actions"


def count_actions(settings: Settings, **counts: int) -> None:
    """Add to the deployment's reconciler counts, best effort (a broker away loses them:
    the exporter says the broker is down)."""
    try:
        client = connection.broker_client(settings)
        try:
            with client.pipeline(transaction=False) as pipe:
                for name, n in counts.items():
                    if n:
                        pipe.hincrby(actions_key(settings), name, n)
                pipe.execute()
        finally:
            client.close()
    except (redis.RedisError, OSError) as exc:
        log.info("reconciler counts not recorded (%s)", exc)


def read_actions(client: redis.Redis, settings: Settings) -> dict[str, int]:
    """The deployment's reconciler counts, every action named (0 where none yet)."""
    raw = client.hgetall(actions_key(settings))
    got = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in raw.items()}
    return {name: got.get(name, 0) for name in ACTIONS}


def reconcile(settings: Settings, *, job_id: int | None = None,
              sessions: sessionmaker[Session] | None = None,
              app: Celery | None = None) -> ReconcileReport:
    """One pass: settle what is finished, re-send what is lost, fill the jobs' turns.
    Raises if the database or the broker cannot be reached. What it did is counted on the
    broker (count_actions)."""
    report = _reconcile(settings, job_id=job_id, sessions=sessions, app=app)
    # every pass is a run, idle or not: the count is how often the deployment looked
    count_actions(settings, runs=1, resent=len(report.resent), refilled=len(report.fed),
                  abandoned=len(report.abandoned),
                  settled=sum(JobStatus(v).finished for v in report.settled.values()))
    return report


def _reconcile(settings: Settings, *, job_id: int | None,
               sessions: sessionmaker[Session] | None, app: Celery | None) -> ReconcileReport:
    from specq.broker.app import make_app

    sessions = sessions or session_factory(settings.sqlalchemy_url, settings.db_timeout)
    report = ReconcileReport()
    with sessions.begin() as s:
        for jid in repo.unsettled_jobs(s, queue_prefix=settings.queue_prefix, job_id=job_id):
            report.settled[jid] = repo.settle_job(s, job_id=jid).value
    with sessions() as s:
        stmt = (select(Job.queue).where(Job.status.in_(RUNNING), Job.queue.is_not(None),
                                        chunks.deployment(settings.queue_prefix))
                .distinct())
        if job_id is not None:
            stmt = stmt.where(Job.id == job_id)
        queues = cast(set[str], set(s.scalars(stmt)))  # queue IS NOT NULL
    if not queues:
        return report
    # the broker first: a message taken by a worker after this read shows as its lease
    client = connection.broker_client(settings)
    try:
        held = dispatch.held(client, queues, recent=settings.reconcile_grace,
                             settings=settings)
    finally:
        client.close()
    report.broker_read = True
    with sessions() as s:
        candidates = chunks.unclaimed(s, grace=settings.reconcile_grace, job_id=job_id,
                                      queue_prefix=settings.queue_prefix)
        # sent within the grace: on the broker or on their way (published after a commit)
        coming = chunks.in_flight(s, grace=settings.reconcile_grace, job_id=job_id,
                                  queue_prefix=settings.queue_prefix)
    report.candidates = len(candidates)
    candidates = _cancel_unclaimed(sessions, candidates, report)
    lost = [c for c in candidates if (c.job_id, c.start) not in held]
    report.on_broker = len(candidates) - len(lost)
    report.abandoned = [c for c in lost if given_up(c, settings.max_chunk_runs)]
    for c in report.abandoned:
        with sessions.begin() as s:
            abandon_chunk(s, c)
        with sessions.begin() as s:
            report.settled[c.job_id] = repo.settle_job(s, job_id=c.job_id).value
    lost = [c for c in lost if not given_up(c, settings.max_chunk_runs)]
    app = app or make_app(settings, tasks=False)
    if lost:
        with sessions.begin() as s:
            chunks.mark_sent(s, refs=lost)
        # a chunk a worker had started (and died on) goes before every chunk waiting its
        # turn; a lost message that no worker ever took rejoins the queue at its job's
        dispatch.deliver(app, sessions, [c for c in lost if c.started], settings,
                         priority=PRIORITY_RESENT)
        dispatch.deliver(app, sessions, [c for c in lost if not c.started], settings)
        report.resent = lost
        log.warning("reconciler: %d chunks re-sent (%s)", len(lost), ", ".join(
            f"job {j}: {n}" for j, n in report.as_dict()["resent_by_job"].items()))
    waiting = Counter(j for j, _ in set(held) | set(coming)) + Counter(c.job_id for c in lost)
    with sessions() as s:
        short = [j for j in chunks.unsent_jobs(s, job_id=job_id,
                                               queue_prefix=settings.queue_prefix)
                 if waiting[j] < settings.dispatch_window]
    for jid in short:
        with sessions.begin() as s:
            refs = chunks.take_unsent(s, job_id=jid, n=settings.dispatch_window - waiting[jid])
        dispatch.deliver(app, sessions, refs, settings)
        report.fed += refs
    if report.fed:
        log.info("reconciler: %d chunks sent to fill their jobs' turns", len(report.fed))
    return report


def _cancel_unclaimed(sessions: sessionmaker[Session], candidates: list[ChunkRef],
                      report: ReconcileReport) -> list[ChunkRef]:
    """The chunks of cancelling jobs among ``candidates`` (no live lease holds them)
    cancelled, never sent again, and their jobs settled (a cancel ends without a worker);
    returns the other candidates."""
    jobs = {c.job_id for c in candidates}
    if not jobs:
        return candidates
    with sessions() as s:
        cancelling = set(s.scalars(select(Job.id).where(
            Job.id.in_(jobs), Job.status == JobStatus.cancelling.value)))
    for c in candidates:
        if c.job_id in cancelling:
            with sessions.begin() as s:
                report.cancelled += chunks.cancel_unclaimed(s, job_id=c.job_id, start=c.start)
    for jid in sorted(cancelling):
        with sessions.begin() as s:
            report.settled[jid] = repo.settle_job(s, job_id=jid).value
    return [c for c in candidates if c.job_id not in cancelling]


def given_up(ref: ChunkRef, most: int) -> bool:
    """Whether a lost chunk's pending items fail instead of a new send: ``most`` messages
    were sent for it, and workers took ``most`` leases on it (and died on it) or its job
    holds a chunk's failure on a worker (one that fails before its items reach the
    engine). Messages the broker alone lost (flushed, restarted empty) fail nothing: no
    worker saw the chunk, and it is sent again for as long as it takes."""
    return ref.sends >= most and (ref.runs >= most or ref.failing)


def abandon_chunk(s: Session, ref: ChunkRef) -> int:
    """Fail the pending items of a chunk sent ``ref.sends`` times that never finished,
    each with its own last error or the job's; the chunk is done. Returns how many."""
    job = repo.lock_job(s, job_id=ref.job_id)
    rows = repo.pending_items(s, job_id=ref.job_id, start=ref.start, end=ref.end)
    why = f"; last failure: {job.error}" if job is not None and job.error else ""
    fail_pending(s, ref.job_id, rows, f"chunk abandoned: sent {ref.sends} times and never "
                 f"finished (SPECQ_MAX_CHUNK_RUNS){why}")
    chunks.mark_done(s, job_id=ref.job_id, start=ref.start)
    log.error("job %d: chunk [%d, %d) abandoned after %d sends; %d items failed%s",
              ref.job_id, ref.start, ref.end, ref.sends, len(rows), why)
    return len(rows)


def fail_pending(s: Session, job_id: int, rows: list, error: str) -> None:
    """Fail these pending items for good (each with its own last error, else ``error``).
    Call under the job's lock."""
    repo.write_outcomes(s, job_id=job_id, outcomes=[
        Outcome.failure(it.index, it.error or error) for it in rows])


def lock_key(settings: Settings) -> str:
    return f"{settings.queue_prefix}:reconcile-lock"


def reconcile_if_due(settings: Settings, **kwargs: Any) -> ReconcileReport | None:
    """reconcile() unless another process of the fleet ran it in the last
    ``reconcile_every`` seconds (a Redis key that expires); None when skipped."""
    client = connection.broker_client(settings)
    try:
        ttl_ms = max(1, int(settings.reconcile_every * 900))  # 90 %: the next tick finds it gone
        if not client.set(lock_key(settings), "1", nx=True, px=ttl_ms):
            return None
    finally:
        client.close()
    return reconcile(settings, **kwargs)


class Background:
    """reconcile_if_due every ``reconcile_every`` seconds in a daemon thread, at a fixed
    rate: a tick is due ``reconcile_every`` after the last one started, not after it ended,
    so a slow pass does not stretch the period (a pass longer than it delays the next)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="reconciler", daemon=True)

    def start(self) -> Background:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        from specq.broker.app import make_app

        app = make_app(self.settings, tasks=False)
        sessions = session_factory(self.settings.sqlalchemy_url, self.settings.db_timeout)
        every = self.settings.reconcile_every
        due = time.monotonic() + every
        while not self.stopped.wait(max(0.0, due - time.monotonic())):
            due = max(due + every, time.monotonic())  # a late tick is not made up twice
            try:
                reconcile_if_due(self.settings, sessions=sessions, app=app)
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("reconciler: broker unreachable (%s); next try in %.0f s", exc,
                            self.settings.reconcile_every)
            except Exception as exc:  # the database away, or a bug: log, try again later
                log.warning("reconciler: %s: %s", type(exc).__name__,
                            str(exc).splitlines()[0] if str(exc) else "")
                if isinstance(exc, SQLAlchemyError):
                    count_actions(self.settings, database_errors=1)
