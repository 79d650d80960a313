"""Chunks: the ranges of a job's items that travel as one task, their leases and their
dispatch records. Keyword-only functions over a Session, like db/repository.py.

The database is the truth about what is left to do; the broker only carries references.
A worker runs a chunk under a lease it renews by heartbeat; the reconciler re-sends a
chunk that is not done, whose lease (if any) has run out, and whose last message was
sent more than a grace period ago and is no longer on the broker (broker/reconciler.py).

A job's chunks are not all sent at once: a few wait on the broker (take_unsent marks the
next ones sent), and each chunk a worker starts sends the next (worker/tasks.py). The
broker's queue then holds a few messages per job, in turns, instead of a huge job's whole
backlog in front of every job submitted after it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, case, func, insert, or_, select, update
from sqlalchemy.orm import Session

from specq.db.clock import db_now, statement_now
from specq.db.models import RUNNING, Chunk, Item, ItemStatus, Job, utcnow
from specq.db.outcomes import storable
from specq.db.session import changed
from specq.schema.counters import ARRAYS, SCALARS

PENDING = ItemStatus.pending.value


@dataclass(frozen=True)
class ChunkRef:
    """What a message carries, a job and an item range, and the queue it goes to."""

    job_id: int
    start: int
    end: int
    queue: str
    started: bool = False  # a worker took it before (and died, or gave up on it)
    priority: str = "normal"  # its job's: high | normal | low
    sends: int = 0  # messages sent for it so far (unclaimed reads it)
    runs: int = 0  # leases taken on it so far (unclaimed reads it)
    failing: bool = False  # its job holds a chunk's failure on a worker (note_job_error)


def insert_chunks(session: Session, *, job_id: int, total: int, chunk_size: int,
                  batch: int = 5000) -> int:
    """The job's chunks, [0, size), [size, 2 size), ..., none sent yet (take_unsent)."""
    stmt = insert(Chunk.__table__)
    starts = range(0, total, chunk_size)
    for i in range(0, len(starts), batch):
        session.execute(stmt, [
            {"job_id": job_id, "start": s, "end": min(s + chunk_size, total), "done": False,
             "sends": 0, "runs": 0}
            for s in starts[i:i + batch]
        ])
    return len(starts)


def _charged(price: float | None, since_now: bool = True) -> dict[str, Any]:
    """The values that charge the chunk's current lease holder for the time since
    ``held_since`` (the seconds, and at ``price`` per device-hour their cost), and restart
    the charge now (or end it: ``since_now`` False). Used in statements that match the
    owner's lease only."""
    c = Chunk.__table__.c
    now = statement_now()  # one value in the statement: the seconds and their price agree
    spent = func.coalesce(now - c.held_since, 0.0)
    values: dict[str, Any] = {"held_seconds": c.held_seconds + spent,
                              "held_since": now if since_now else None}
    if price is not None:
        values["cost"] = func.coalesce(c.cost, 0.0) + spent * (price / 3600.0)
    return values


@dataclass(frozen=True)
class Lease:
    """A chunk's lease as a takeover finds it: its owner, and the seconds since it ran out
    (negative while it runs), on the database's clock."""

    owner: str
    lapsed: float


def lease(session: Session, *, job_id: int, start: int) -> Lease | None:
    """The chunk's lease, None if no run holds one (or the chunk does not exist)."""
    c = Chunk.__table__.c
    row = session.execute(select(c.lease_owner, db_now() - c.lease_until)
                          .where(c.job_id == job_id, c.start == start)).first()
    if row is None or row[0] is None:
        return None
    return Lease(row[0], float(row[1]) if row[1] is not None else 0.0)


def claim(session: Session, *, job_id: int, start: int, owner: str, ttl: float,
          price: float | None = None) -> int | None:
    """Take the chunk's lease for ``ttl`` seconds unless another live lease holds it.

    The run's charge starts now (``price``: its worker's price per device-hour); the time a
    dead holder had not charged is charged to no one. Returns how many leases were ever
    taken on the chunk (this one included), or None if another owner holds it (or the
    chunk does not exist).
    """
    c = Chunk.__table__.c
    mine = c.lease_owner == owner  # claiming again what it holds: charge it up to now first
    charged = _charged(price)
    taken = changed(session.execute(
        update(Chunk.__table__)
        .where(c.job_id == job_id, c.start == start,
               or_(c.lease_owner.is_(None), c.lease_until < db_now(), mine))
        # a chunk run with no message (the embedded mode runs them in-process) counts as
        # sent: no message is sent for it later
        .values(lease_owner=owner, lease_until=db_now() + ttl, runs=c.runs + 1,
                leased_at=func.coalesce(c.leased_at, db_now()),
                sent_at=func.coalesce(c.sent_at, db_now()),
                held_since=statement_now(),
                **{k: case((mine, v), else_=getattr(c, k))
                   for k, v in charged.items() if k != "held_since"})
    ))
    if not taken:
        return None
    return session.scalar(select(c.runs).where(c.job_id == job_id, c.start == start))


def renew(session: Session, *, job_id: int, start: int, owner: str, ttl: float,
          price: float | None = None) -> bool:
    """Extend the lease by ``ttl`` seconds from now, charging the run up to now; False if
    ``owner`` no longer holds it."""
    c = Chunk.__table__.c
    return bool(changed(session.execute(
        update(Chunk.__table__)
        .where(c.job_id == job_id, c.start == start, c.lease_owner == owner)
        .values(lease_until=db_now() + ttl, **_charged(price))
    )))


def holds(session: Session | Connection, *, job_id: int, start: int, owner: str,
          live: bool = False) -> bool:
    """Whether ``owner`` holds the chunk's lease now: the guard of every write of a run
    (worker/keeper.py). The chunk's row is locked for share until the transaction ends, so
    a takeover (claim) waits for the write and then sees it, or came first and the write
    is refused. An owner whose lease ran out still holds it until another claims it: the
    outcomes it kept through a database outage are still its to write. ``live``: only a
    lease that has not run out holds (a launch mark: what a takeover charges)."""
    c = Chunk.__table__.c
    stmt = select(c.start).where(c.job_id == job_id, c.start == start, c.lease_owner == owner)
    if live:
        stmt = stmt.where(c.lease_until > db_now())
    return session.execute(stmt.with_for_update(read=True)).first() is not None


def charge(session: Session, *, job_id: int, start: int, owner: str,
           price: float | None = None) -> None:
    """Charge ``owner``'s run of the chunk up to now (with each write of its outcomes: a
    run killed later is charged to its last write)."""
    c = Chunk.__table__.c
    session.execute(
        update(Chunk.__table__)
        .where(c.job_id == job_id, c.start == start, c.lease_owner == owner)
        .values(**_charged(price)))


def release(session: Session, *, job_id: int, start: int, end: int, owner: str,
            price: float | None = None) -> bool:
    """Give the lease back, its run charged up to now, marking the chunk done when none of
    its items is pending. Returns whether it is done."""
    c = Chunk.__table__.c
    done = not pending_count(session, job_id=job_id, start=start, end=end)
    session.execute(
        update(Chunk.__table__)
        .where(c.job_id == job_id, c.start == start, c.lease_owner == owner)
        .values(lease_owner=None, lease_until=None, done=done,
                **_charged(price, since_now=False))
    )
    return done


def mark_done(session: Session, *, job_id: int, start: int) -> None:
    c = Chunk.__table__.c
    session.execute(update(Chunk.__table__).where(c.job_id == job_id, c.start == start)
                    .values(done=True))


def pending_count(session: Session, *, job_id: int, start: int, end: int) -> int:
    return session.scalars(
        select(func.count()).where(Item.job_id == job_id, Item.index >= start,
                                   Item.index < end, Item.status == PENDING)
    ).one()


def deployment(queue_prefix: str) -> Any:
    """The jobs of the deployment whose queues are named ``queue_prefix``.PAIR: its
    reconciler sends their chunks, and only theirs (another deployment sharing the database
    keeps its messages behind another key prefix, where this one cannot see them)."""
    return Job.queue.startswith(f"{queue_prefix}.", autoescape=True)


def _unleased_sent(*columns: Any, job_id: int | None, queue_prefix: str | None) -> Any:
    """``columns`` of the chunks of unfinished jobs that were sent, are not done and that no
    live lease holds (of one job, of one deployment's jobs with ``queue_prefix``)."""
    c = Chunk.__table__.c
    stmt = (select(*columns).join(Job, Job.id == c.job_id)
            .where(Job.status.in_(RUNNING), Job.queue.is_not(None), c.done.is_(False),
                   or_(c.lease_owner.is_(None), c.lease_until < db_now()),
                   c.sent_at.is_not(None)))
    if job_id is not None:
        stmt = stmt.where(c.job_id == job_id)
    if queue_prefix is not None:
        stmt = stmt.where(deployment(queue_prefix))
    return stmt


def unclaimed(session: Session, *, grace: float, job_id: int | None = None,
              queue_prefix: str | None = None) -> list[ChunkRef]:
    """Chunks of unfinished jobs that were sent, are not done, that no live lease holds,
    and whose last message was sent more than ``grace`` seconds ago: the candidates for
    re-sending (of one deployment's jobs with ``queue_prefix``)."""
    c = Chunk.__table__.c
    stmt = _unleased_sent(c.job_id, c.start, c.end, Job.queue, c.runs > 0, Job.priority,
                          c.sends, c.runs, Job.error.is_not(None), job_id=job_id,
                          queue_prefix=queue_prefix)
    stmt = stmt.where(c.sent_at < db_now() - grace).order_by(c.job_id, c.start)
    return [ChunkRef(*row) for row in session.execute(stmt)]


def in_flight(session: Session, *, grace: float, job_id: int | None = None,
              queue_prefix: str | None = None) -> list[tuple[int, int]]:
    """(job_id, start) of the chunks sent within the last ``grace`` seconds that no lease
    holds: their messages are on the broker, or about to be (a producer marks a chunk sent
    in the transaction that stores it and publishes the message after the commit), so
    they count in their job's turn though the broker may not show them yet."""
    c = Chunk.__table__.c
    stmt = _unleased_sent(c.job_id, c.start, job_id=job_id, queue_prefix=queue_prefix)
    return [(j, start) for j, start in session.execute(stmt.where(c.sent_at >= db_now() - grace))]


def take_unsent(session: Session, *, job_id: int, n: int) -> list[ChunkRef]:
    """Mark the job's next ``n`` unsent chunks (in item order) sent now and return them,
    for the caller to send once this transaction commits (if it dies first, the
    reconciler sends them after its grace). Concurrent callers take different chunks."""
    if n <= 0:
        return []
    c = Chunk.__table__.c
    job = session.execute(select(Job.queue, Job.priority).where(Job.id == job_id)).first()
    if job is None or job.queue is None:
        return []
    # two statements: PostgreSQL may run an IN (... LIMIT n) subquery more than once
    starts = list(session.scalars(
        select(c.start).where(c.job_id == job_id, c.sent_at.is_(None), c.done.is_(False))
        .order_by(c.start).limit(n).with_for_update(skip_locked=True)))
    if not starts:
        return []
    rows = session.execute(
        update(Chunk.__table__)
        .where(c.job_id == job_id, c.start.in_(starts))
        .values(sent_at=db_now(), sends=c.sends + 1)
        .returning(c.start, c.end)
    ).all()
    return [ChunkRef(job_id, start, end, job.queue, priority=job.priority)
            for start, end in sorted(rows)]


def unsend(session: Session, *, refs: Iterable[ChunkRef]) -> None:
    """Undo take_unsent for chunks whose messages could not be sent."""
    c = Chunk.__table__.c
    _update_each(session, refs, sent_at=None, sends=c.sends - 1)


def _update_each(session: Session, refs: Iterable[ChunkRef], **values: Any) -> None:
    """Set ``values`` on each of these chunks, in one statement run for all of them."""
    c = Chunk.__table__.c
    rows = [{"b_job": r.job_id, "b_start": r.start} for r in refs]
    if rows:
        session.execute(
            update(Chunk.__table__)
            .where(c.job_id == bindparam("b_job"), c.start == bindparam("b_start"))
            .values(**values),
            rows,
        )


def unsent_jobs(session: Session, *, job_id: int | None = None,
                queue_prefix: str | None = None) -> list[int]:
    """Unfinished jobs with a queue that have chunks no message was sent for yet (of one
    deployment's jobs with ``queue_prefix``)."""
    c = Chunk.__table__.c
    stmt = (select(Job.id).where(Job.status.in_(RUNNING), Job.queue.is_not(None))
            .where(select(c.start).where(c.job_id == Job.id, c.sent_at.is_(None),
                                         c.done.is_(False)).exists())
            .order_by(Job.id))
    if job_id is not None:
        stmt = stmt.where(Job.id == job_id)
    if queue_prefix is not None:
        stmt = stmt.where(deployment(queue_prefix))
    return list(session.scalars(stmt))


def cancel_unsent(session: Session, *, job_id: int) -> int:
    """A cancelled job's chunks that were never sent: they are done (no worker will run
    them) and their pending items cancelled. Returns the items cancelled.

    The chunks are marked done first, by one UPDATE that locks them: a worker taking the
    job's next turn at the same moment (take_unsent, SKIP LOCKED) either took a chunk
    before (it is sent, and its worker cancels its items when it opens it) or cannot take
    it now. Only these chunks' rows are locked: a running chunk's row is its worker's (a
    worker giving its lease back locks its chunk, then the job)."""
    c, items = Chunk.__table__.c, Item.__table__.c
    starts = list(session.scalars(
        update(Chunk.__table__)
        .where(c.job_id == job_id, c.sent_at.is_(None), c.done.is_(False))
        .values(done=True).returning(c.start)))
    n = 0
    for i in range(0, len(starts), 1000):
        part = starts[i:i + 1000]
        in_part = (select(c.start).where(c.job_id == job_id, c.start.in_(part),
                                         items.index >= c.start, items.index < c.end)
                   .exists())
        n += changed(session.execute(
            update(Item.__table__)
            .where(items.job_id == job_id, items.status == PENDING, in_part)
            .values(status=ItemStatus.cancelled.value, finished_at=utcnow())
        ))
        recount(session, job_id=job_id, starts=part)
    return n

def cancel_unclaimed(session: Session, *, job_id: int, start: int) -> int:
    """A cancelling job's chunk that was sent but that no live lease holds (its message
    waits on the broker or was lost, or its worker died): done, and its pending items
    cancelled, as cancel_unsent does for chunks never sent; without it the job waits for a
    worker of its pair to open the chunk, for ever if none comes. The UPDATE that marks it
    done takes it only while no live lease holds it: a worker leasing it at the same moment
    either leased it first (and cancels its items itself) or finds it done. The items'
    launch marks go with them. Returns the items cancelled."""
    c, items = Chunk.__table__.c, Item.__table__.c
    end = session.scalar(
        update(Chunk.__table__)
        .where(c.job_id == job_id, c.start == start, c.done.is_(False),
               or_(c.lease_owner.is_(None), c.lease_until < db_now()))
        .values(done=True).returning(c.end))
    if end is None:
        return 0
    n = changed(session.execute(
        update(Item.__table__)
        .where(items.job_id == job_id, items.status == PENDING, items.index >= start,
               items.index < end)
        .values(status=ItemStatus.cancelled.value, finished_at=utcnow(), launch=None)))
    recount(session, job_id=job_id, starts=[start])
    return n


def mark_sent(session: Session, *, refs: Iterable[ChunkRef]) -> None:
    """Stamp chunks as sent now, once their messages are on the broker."""
    c = Chunk.__table__.c
    _update_each(session, refs, sent_at=db_now(), sends=c.sends + 1)


def containing(session: Session, *, job_id: int, indices: Iterable[int]) -> list[ChunkRef]:
    """The job's chunks that hold any of these item indices, in order (as the chunks
    table records their ranges)."""
    wanted = sorted(set(indices))
    if not wanted:
        return []
    c = Chunk.__table__.c
    rows = session.execute(
        select(c.start, c.end, Job.queue, Job.priority).join(Job, Job.id == c.job_id)
        .where(c.job_id == job_id, c.end > wanted[0], c.start <= wanted[-1])
        .order_by(c.start)).all()
    ends = [end for _, end, _, _ in rows]
    hit = {bisect_right(ends, i) for i in wanted}  # the first chunk ending after i holds i
    return [ChunkRef(job_id, start, end, queue, priority=priority)
            for k, (start, end, queue, priority) in enumerate(rows) if k in hit]


def ranges(session: Session, *, job_id: int) -> list[tuple[int, int]]:
    """Every chunk of the job, [start, end), in order."""
    c = Chunk.__table__.c
    return [tuple(r) for r in session.execute(
        select(c.start, c.end).where(c.job_id == job_id).order_by(c.start))]


def reopen(session: Session, *, job_id: int, indices: Iterable[int]) -> list[ChunkRef]:
    """Mark the chunks holding these item indices not done (items went back to pending);
    they count as sent now, once, and as never run: a retry gives each max_chunk_runs
    runs and sends again, as it gives each item max_attempts attempts. Returns them."""
    refs = containing(session, job_id=job_id, indices=indices)
    c = Chunk.__table__.c
    for i in range(0, len(refs), 1000):
        part = [r.start for r in refs[i:i + 1000]]
        session.execute(update(Chunk.__table__)
                        .where(c.job_id == job_id, c.start.in_(part))
                        .values(done=False, sent_at=db_now(), sends=1, runs=0))
    return refs


def add_fault(session: Session, *, job_id: int, start: int, error: str) -> None:
    """One more fault met while running the chunk at ``start``; the first one's error and
    time (database clock) are kept."""
    c = Chunk.__table__.c
    error = storable(error)[:2000]
    session.execute(
        update(Chunk.__table__).where(c.job_id == job_id, c.start == start)
        .values(faults=c.faults + 1,
                first_fault=func.coalesce(c.first_fault, error),
                first_fault_at=func.coalesce(c.first_fault_at, db_now()))
    )


def faults(session: Session, *, job_id: int) -> tuple[int, str | None, int]:
    """The job's faults, added up from its chunks: (how many, the earliest one's error,
    items that ran alone after one)."""
    c = Chunk.__table__.c
    n, isolated = session.execute(
        select(func.coalesce(func.sum(c.faults), 0), func.coalesce(func.sum(c.isolated), 0))
        .where(c.job_id == job_id)).one()
    first = session.scalar(
        select(c.first_fault).where(c.job_id == job_id, c.first_fault.is_not(None))
        .order_by(c.first_fault_at, c.start).limit(1)) if n else None
    return int(n), first, int(isolated)


# -- the sums of the chunks' item counters (what a job's metrics read) -------------------


def add_sums(session: Session, *, job_id: int, outcomes: Iterable[Any],
             charge: tuple[int, float | None] | None = None) -> bool:
    """Add the counters of outcomes (db/outcomes.py) just written to their chunks' sums.
    Call in the transaction that wrote them; each outcome must be written once.

    ``charge`` (start, price): the run holding that chunk's lease, checked in this
    transaction (holds), is charged up to now in the same UPDATE of the chunk's row; a
    write's sums and its charge are one statement. Returns whether it was charged (not
    when no outcome fell in that chunk: then the caller charges)."""
    outcomes = list(outcomes)
    if not outcomes:
        return False
    lo, hi = min(o.index for o in outcomes), max(o.index for o in outcomes)
    c = Chunk.__table__.c
    first = select(func.max(c.start)).where(c.job_id == job_id, c.start <= lo)
    rows = session.scalars(
        select(Chunk).where(Chunk.job_id == job_id, Chunk.start >= first.scalar_subquery(),
                            Chunk.start <= hi)
        .order_by(Chunk.start).with_for_update()
    ).all()
    starts = [c.start for c in rows]
    sums: dict[int, _Sums] = {}
    for o in outcomes:
        k = bisect_right(starts, o.index) - 1
        if k >= 0 and o.index < rows[k].end:
            more = sums.setdefault(k, _Sums())
            more.add(ItemStatus(o.status).value, o.counters, o.started_at, o.finished_at,
                     o.prompt_tokens)
            more.isolated += o.isolated
    for k, more in sums.items():
        more.into(rows[k])
    held = next((k for k in sums if charge is not None and rows[k].start == charge[0]), None)
    if held is None or charge is None:
        return False
    for name, value in _charged(charge[1]).items():  # SQL expressions, in the row's UPDATE
        setattr(rows[held], name, value)
    return True


def recount(session: Session, *, job_id: int, start: int | None = None,
            starts: list[int] | None = None) -> None:
    """Count the items of the job's chunks (or of the one at ``start``, or of those at
    ``starts``) by status again (after items were cancelled: db/repository.py:
    cancel_pending, cancel_unsent)."""
    c, i = Chunk.__table__.c, Item.__table__.c

    def count(status: ItemStatus) -> Any:
        return (select(func.count()).where(i.job_id == c.job_id, i.index >= c.start,
                                           i.index < c.end, i.status == status.value)
                .scalar_subquery())

    stmt = update(Chunk.__table__).where(c.job_id == job_id).values(
        completed=count(ItemStatus.completed), failed=count(ItemStatus.failed),
        cancelled=count(ItemStatus.cancelled))
    if start is not None:
        stmt = stmt.where(c.start == start)
    if starts is not None:
        stmt = stmt.where(c.start.in_(starts))
    session.execute(stmt)


def resum(session: Session, *, job_id: int, starts: Iterable[int]) -> None:
    """Compute these chunks' sums again from their items (after items changed other than
    by a write: `specq retry`)."""
    counters = [getattr(Item, name) for name in SCALARS + ARRAYS]
    starts = list(starts)
    for start in starts:
        recount(session, job_id=job_id, start=start)
    for chunk in session.scalars(select(Chunk).where(Chunk.job_id == job_id,
                                                      Chunk.start.in_(starts))):
        for name in SCALARS + ARRAYS:
            setattr(chunk, name, None)
        chunk.first_started = chunk.last_finished = chunk.prompt_tokens = None
        rows = session.execute(
            select(Item.started_at, Item.finished_at, Item.prompt_tokens, *counters)
            .where(Item.job_id == job_id, Item.index >= chunk.start, Item.index < chunk.end,
                   Item.__table__.c.draft_steps.is_not(None))
        )
        more = _Sums()
        for started, finished, prompt_tokens, *values in rows:
            more.add(None, dict(zip(SCALARS + ARRAYS, values)), started, finished,
                     prompt_tokens)
        more.into(chunk)


class _Sums:
    """Items' counts by status and counter sums, gathered in plain Python, then added to
    a chunk's row at once."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.scalars: dict[str, float] = dict.fromkeys(SCALARS, 0)
        self.arrays: dict[str, list[int]] = {name: [] for name in ARRAYS}
        self.counted = False  # an item with counters was added
        self.isolated = 0  # items that ran alone after a fault
        self.first: datetime | None = None
        self.last: datetime | None = None
        self.prompt_tokens = 0  # of the items with counters

    def add(self, status: str | None, counters: Any, started: datetime | None,
            finished: datetime | None, prompt_tokens: int | None = None) -> None:
        """One item: its status (None: not counted), its counters (a Counters, a dict of
        them, or None: it never reached the engine) and its prompt's tokens."""
        if status is not None:
            self.counts[status] = self.counts.get(status, 0) + 1
        if counters is None:
            return
        self.prompt_tokens += prompt_tokens or 0
        get = counters.get if isinstance(counters, dict) else counters.__getattribute__
        for name in SCALARS:
            self.scalars[name] += get(name) or 0
        for name in ARRAYS:
            _add_into(self.arrays[name], get(name) or [])
        self.counted = True
        self.first = _extreme(min, self.first, started)
        self.last = _extreme(max, self.last, finished)

    def into(self, chunk: Chunk) -> None:
        for status, n in self.counts.items():
            setattr(chunk, status, (getattr(chunk, status) or 0) + n)
        chunk.isolated = (chunk.isolated or 0) + self.isolated
        if not self.counted:
            return
        for name, value in self.scalars.items():
            setattr(chunk, name, (getattr(chunk, name) or 0) + value)
        for name, more in self.arrays.items():
            total = list(getattr(chunk, name) or [])
            _add_into(total, more)
            setattr(chunk, name, total)
        chunk.prompt_tokens = (chunk.prompt_tokens or 0) + self.prompt_tokens
        chunk.first_started = _extreme(min, chunk.first_started, self.first)
        chunk.last_finished = _extreme(max, chunk.last_finished, self.last)


def _add_into(total: list[int], more: list[int]) -> None:
    """total += more, element-wise, total grown to fit."""
    total += [0] * (len(more) - len(total))
    for i, n in enumerate(more):
        total[i] += n


def _extreme(pick: Any, a: datetime | None, b: datetime | None) -> datetime | None:
    """min or max of two stored times, either None (SQLite hands them back without a zone)."""
    if a is None or b is None:
        return a if b is None else b
    if (a.tzinfo is None) != (b.tzinfo is None):
        naive = pick(a.replace(tzinfo=None), b.replace(tzinfo=None))
        return a if naive == a.replace(tzinfo=None) else b
    return pick(a, b)
