"""Chunks: the ranges of a job's items that travel as one task, their leases and their
dispatch records. Keyword-only functions over a Session, like db/repository.py.

The database is the truth about what is left to do; the broker only carries references.
A worker runs a chunk under a lease it renews by heartbeat; the reconciler re-sends a
chunk that is not done, whose lease (if any) has run out, and whose last message was
sent more than a grace period ago and is no longer on the broker (worker/reconciler.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import and_, bindparam, func, insert, or_, select, update
from sqlalchemy.orm import Session

from specq.db.clock import db_now
from specq.db.models import Chunk, Item, ItemStatus, Job, JobStatus

PENDING = ItemStatus.pending.value
UNFINISHED = tuple(s.value for s in JobStatus if not s.finished and s != JobStatus.validating)


@dataclass(frozen=True)
class ChunkRef:
    """What a message carries, a job and an item range, and the queue it goes to."""

    job_id: int
    start: int
    end: int
    queue: str
    started: bool = False  # a worker took it before (and died, or gave up on it)


def insert_chunks(session: Session, *, job_id: int, total: int, chunk_size: int,
                  batch: int = 5000) -> int:
    """The job's chunks, [0, size), [size, 2 size), ...; stamped as sent now (the producer
    sends them next: if it dies first, the reconciler sends them after its grace)."""
    stmt = insert(Chunk.__table__).values(sent_at=db_now())
    starts = range(0, total, chunk_size)
    for i in range(0, len(starts), batch):
        session.execute(stmt, [
            {"job_id": job_id, "start": s, "end": min(s + chunk_size, total), "done": False,
             "sends": 0, "runs": 0}
            for s in starts[i:i + batch]
        ])
    return len(starts)


def claim(session: Session, *, job_id: int, start: int, owner: str, ttl: float) -> int | None:
    """Take the chunk's lease for ``ttl`` seconds unless another live lease holds it.

    Returns how many leases were ever taken on the chunk (this one included), or None if
    another owner holds it (or the chunk does not exist).
    """
    c = Chunk.__table__.c
    taken = session.execute(
        update(Chunk.__table__)
        .where(c.job_id == job_id, c.start == start,
               or_(c.lease_owner.is_(None), c.lease_until < db_now(), c.lease_owner == owner))
        .values(lease_owner=owner, lease_until=db_now() + ttl, runs=c.runs + 1)
    ).rowcount
    if not taken:
        return None
    return session.scalar(select(c.runs).where(c.job_id == job_id, c.start == start))


def renew(session: Session, *, job_id: int, start: int, owner: str, ttl: float) -> bool:
    """Extend the lease by ``ttl`` seconds from now; False if ``owner`` no longer holds it."""
    c = Chunk.__table__.c
    return bool(session.execute(
        update(Chunk.__table__)
        .where(c.job_id == job_id, c.start == start, c.lease_owner == owner)
        .values(lease_until=db_now() + ttl)
    ).rowcount)


def release(session: Session, *, job_id: int, start: int, end: int, owner: str) -> bool:
    """Give the lease back, marking the chunk done when none of its items is pending.
    Returns whether it is done."""
    c = Chunk.__table__.c
    done = not pending_count(session, job_id=job_id, start=start, end=end)
    session.execute(
        update(Chunk.__table__)
        .where(c.job_id == job_id, c.start == start, c.lease_owner == owner)
        .values(lease_owner=None, lease_until=None, done=done)
    )
    return done


def mark_done(session: Session, *, job_id: int, start: int) -> None:
    c = Chunk.__table__.c
    session.execute(update(Chunk.__table__).where(c.job_id == job_id, c.start == start)
                    .values(done=True))


def pending_count(session: Session, *, job_id: int, start: int, end: int) -> int:
    return session.scalar(
        select(func.count()).where(Item.job_id == job_id, Item.index >= start,
                                   Item.index < end, Item.status == PENDING)
    )


def unclaimed(session: Session, *, grace: float, job_id: int | None = None) -> list[ChunkRef]:
    """Chunks of unfinished jobs that are not done, that no live lease holds, and whose
    last message was sent more than ``grace`` seconds ago: the candidates for re-sending."""
    c = Chunk.__table__.c
    stmt = (
        select(c.job_id, c.start, c.end, Job.queue, c.runs > 0)
        .join(Job, Job.id == c.job_id)
        .where(Job.status.in_(UNFINISHED), Job.queue.is_not(None), c.done.is_(False),
               or_(c.lease_owner.is_(None), c.lease_until < db_now()),
               or_(c.sent_at.is_(None), c.sent_at < db_now() - grace))
        .order_by(c.job_id, c.start)
    )
    if job_id is not None:
        stmt = stmt.where(c.job_id == job_id)
    return [ChunkRef(*row) for row in session.execute(stmt)]


def mark_sent(session: Session, *, refs: Iterable[ChunkRef]) -> None:
    """Stamp chunks as sent now, once their messages are on the broker."""
    c = Chunk.__table__.c
    rows = [{"b_job": r.job_id, "b_start": r.start} for r in refs]
    if rows:
        session.execute(
            update(Chunk.__table__)
            .where(c.job_id == bindparam("b_job"), c.start == bindparam("b_start"))
            .values(sent_at=db_now(), sends=c.sends + 1),
            rows,
        )


def mark_job_sent(session: Session, *, job_id: int) -> None:
    """Stamp every chunk of a job as sent now (after the producer sent them all)."""
    c = Chunk.__table__.c
    session.execute(update(Chunk.__table__).where(c.job_id == job_id)
                    .values(sent_at=db_now(), sends=c.sends + 1))


def reopen(session: Session, *, job_id: int, indices: Iterable[int]) -> list[ChunkRef]:
    """Mark the chunks holding these item indices not done (items went back to pending);
    they count as sent now. Returns them."""
    job = session.get(Job, job_id)
    starts = sorted({i - i % job.chunk_size for i in indices})
    c = Chunk.__table__.c
    refs = []
    for i in range(0, len(starts), 1000):
        part = starts[i:i + 1000]
        session.execute(update(Chunk.__table__)
                        .where(c.job_id == job_id, c.start.in_(part))
                        .values(done=False, sent_at=db_now()))
        refs += [ChunkRef(job_id, s, min(s + job.chunk_size, job.total), job.queue)
                 for s in part]
    return refs


def live_leases(session: Session, *, job_id: int | None = None) -> list[tuple[int, int, str]]:
    """(job id, start, owner) of every lease that has not run out."""
    c = Chunk.__table__.c
    stmt = select(c.job_id, c.start, c.lease_owner).where(
        and_(c.lease_owner.is_not(None), c.lease_until >= db_now()))
    if job_id is not None:
        stmt = stmt.where(c.job_id == job_id)
    return [tuple(r) for r in session.execute(stmt)]
