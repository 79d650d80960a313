"""Reads and writes of jobs and items; keyword-only functions over a Session.

Outcomes are written without the job's lock (each item is written once, whoever else
writes), and a job is settled (ended once none of its items is pending) by one conditional
UPDATE, so workers finishing chunks of one job never queue on its row. A job's metrics are
read from the SQL views (db/views.py), where every figure is defined.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    Connection,
    RowMapping,
    bindparam,
    case,
    func,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql.schema import ScalarElementColumnDefault
from sqlalchemy.types import JSON, DateTime, Float

from specq.db import chunks, views, webhooks
from specq.db.models import RUNNING, UNFINISHED, Chunk, Item, ItemStatus, Job, JobStatus, utcnow
from specq.db.outcomes import COLUMNS as OUTCOME_COLUMNS
from specq.db.outcomes import Outcome, storable
from specq.db.session import changed
from specq.schema.counters import ARRAYS, SCALARS
from specq.schema.errors import NotFound

PENDING = ItemStatus.pending.value
OUTCOME_COUNTERS = SCALARS + ARRAYS


def create_job(
    session: Session, *, pair: str, params: dict[str, Any], chunk_size: int, source: str | None,
    queue: str | None = None, origin: dict[str, Any] | None = None,
    drafting: dict[str, Any] | None = None, priority: str = "normal",
) -> Job:
    """``queue``: where its chunks are sent (None: nowhere, the caller runs them);
    ``origin``: a synthesis run's spec, schedule and synthesis (resolved spec) columns;
    ``drafting``: how its pair drafts (configs/presets.py: PairPreset.drafting)."""
    job = Job(pair=pair, params=params, chunk_size=chunk_size, source=source, queue=queue,
              priority=priority, status=JobStatus.validating.value, total=0,
              **(origin or {}), **(drafting or {}))
    session.add(job)
    session.flush()
    return job


def insert_items(
    session: Session, *, job_id: int, rows: Iterable[dict[str, Any]], batch: int = 2000
) -> int:
    """Insert items (dicts of item columns: index, custom_id, prompt, messages, params, or
    more), streamed; returns the
    count. PostgreSQL takes them by one COPY (about four times the rate of INSERTs: a
    million rows in well under a minute), storing what an INSERT stores (the columns' own
    defaults, a JSON column's None as JSON null); other databases in INSERTs of ``batch``
    rows."""
    table = Item.__table__
    dialect = session.get_bind().dialect
    if dialect.name == "postgresql":
        rows = iter(rows)
        first = next(rows, None)
        if first is None:
            return 0
        base = {c.name: c.default.arg for c in table.columns
                if isinstance(c.default, ScalarElementColumnDefault)}
        base.update(job_id=job_id, status=PENDING, writes=0)
        names = [*base, *(k for k in first if k not in base)]
        is_json = [isinstance(table.c[k].type, JSON) for k in names]

        def as_json(value: Any) -> str:
            return "null" if value is None else json.dumps(value)  # SQLAlchemy's JSON text

        quote = dialect.identifier_preparer.quote
        sql = f"COPY {quote(table.name)} ({', '.join(map(quote, names))}) FROM STDIN"
        raw: Any = session.connection().connection.driver_connection  # psycopg's
        n = 0
        try:
            with raw.cursor() as cur, cur.copy(sql) as copy:
                for row in itertools.chain((first,), rows):
                    values = {**base, **row}
                    copy.write_row([as_json(values[k]) if j else values[k]
                                    for k, j in zip(names, is_json)])
                    n += 1
        except raw.Error as exc:  # as SQLAlchemy raises it: IntegrityError for a duplicate
            raise DBAPIError.instance(sql, None, exc, raw.Error) from exc
        return n
    stmt = insert(table)
    n = 0
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append({"job_id": job_id, "status": PENDING, "writes": 0, **row})
        if len(chunk) >= batch:
            session.execute(stmt, chunk)
            n += len(chunk)
            chunk = []
    if chunk:
        session.execute(stmt, chunk)
        n += len(chunk)
    return n


def get_job(session: Session, *, job_id: int) -> Job | None:
    return session.execute(
        select(Job).where(Job.id == job_id).execution_options(populate_existing=True)
    ).scalar_one_or_none()


def require_job(session: Session, *, job_id: int) -> Job:
    """The job, which the caller knows exists; KeyError naming it if it does not."""
    job = get_job(session, job_id=job_id)
    if job is None:
        raise NotFound(f"job {job_id}: not found")
    return job


def unfinished_runs(session: Session, *, schedule: str) -> list[int]:
    """Ids of the jobs of ``schedule`` that are not finished yet."""
    return list(session.scalars(
        select(Job.id).where(Job.schedule == schedule, Job.status.in_(UNFINISHED))
    ))


def unwritten_runs(session: Session) -> list[int]:
    """Ids of the finished synthesis jobs whose data set is not written yet."""
    finished = [s.value for s in JobStatus if s.finished]
    return list(session.scalars(
        select(Job.id).where(Job.spec.is_not(None), Job.output_path.is_(None),
                             Job.status.in_(finished)).order_by(Job.id)
    ))


def set_output_path(session: Session, *, job_id: int, path: str) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(output_path=path))


def lock_job(session: Session, *, job_id: int) -> Job | None:
    """Take the job's row lock for the rest of the transaction (an UPDATE locks the row
    in PostgreSQL and takes the write lock in SQLite) and return the job as committed."""
    session.execute(update(Job).where(Job.id == job_id).values(status=Job.status))
    return get_job(session, job_id=job_id)


def set_job_status(
    session: Session, *, job_id: int, status: JobStatus, error: str | None = None
) -> None:
    values: dict[str, Any] = {"status": status.value}
    if error is not None:
        values["error"] = error
    if status.finished:
        values["finished_at"] = utcnow()
    session.execute(update(Job).where(Job.id == job_id).values(**values))
    if status.finished:
        webhooks.job_ended(session, job_id=job_id)  # its events, in this transaction


def note_job_error(session: Session, *, job_id: int, error: str) -> None:
    """Keep ``error`` on an unfinished job without ending it: why its chunks fail on the
    workers (`specq status` shows it while the reconciler sends them again)."""
    session.execute(update(Job).where(Job.id == job_id, Job.finished_at.is_(None))
                    .values(error=error[:10000]))


def start_job(session: Session, *, job_id: int) -> None:
    """queued → in_progress, at the first chunk a worker takes."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.queued.value)
        .values(status=JobStatus.in_progress.value, started_at=utcnow())
    )


def pending_items(session: Session, *, job_id: int, start: int, end: int) -> list[Item]:
    """The chunk's items that have no outcome yet, in index order."""
    return list(session.scalars(
        select(Item)
        .where(Item.job_id == job_id, Item.index >= start, Item.index < end,
               Item.status == PENDING)
        .order_by(Item.index)
    ))


def pending_work(session: Session, *, job_id: int, start: int, end: int) -> list[Any]:
    """pending_items as rows of what a run reads of each (index, prompt, messages, params,
    attempts, retries, crashes, error), in index order: a chunk's start reads 500 of them,
    and plain rows cost a fraction of ORM objects."""
    i = Item.__table__.c
    return list(session.execute(
        select(i.index, i.prompt, i.messages, i.params, i.attempts, i.retries, i.crashes,
               i.error)
        .where(i.job_id == job_id, i.index >= start, i.index < end, i.status == PENDING)
        .order_by(i.index)
    ))


def write_outcomes(session: Session, *, job_id: int, outcomes: list[Outcome]) -> int:
    """Write each outcome to its item, once.

    Idempotent: only pending items are written, so a redelivered chunk changes nothing
    already written. Returns how many items were written.
    """
    return len(store_outcomes(session, job_id=job_id, outcomes=outcomes))


def store_outcomes(session: Session, *, job_id: int, outcomes: list[Outcome],
                   charge: tuple[int, str, float | None] | None = None) -> list[Outcome]:
    """write_outcomes, returning the outcomes written (a worker counts them: worker/metrics.py).
    ``charge`` (start, owner, price): charge that owner's run of the chunk at ``start`` up
    to now (chunks.charge), with the sums' own UPDATE where it can.

    An item listed twice is written once, with its first outcome. On PostgreSQL each
    call is one UPDATE over arrays of the outcomes that returns the items it wrote:
    a writer racing for the same items waits on their rows, then finds them written (the
    pending test is checked again on the row it waited for), so the chunk sums below
    count each item once. Elsewhere the pending items are read, then updated one by one."""
    unique = _first_each(outcomes)
    written: list[Outcome] = []
    if unique and session.get_bind().dialect.name == "postgresql":
        written = _store_set(session, job_id, unique)
    elif unique:
        written = _store_each(session, job_id, unique)
    held = None if charge is None else (charge[0], charge[2])
    if not chunks.add_sums(session, job_id=job_id, outcomes=written,
                           charge=held) and charge is not None:
        chunks.charge(session, job_id=job_id, start=charge[0], owner=charge[1],
                      price=charge[2])
    return written


def _first_each(outcomes: list[Outcome]) -> list[Outcome]:
    """The outcomes in order, only the first of each item."""
    first: dict[int, Outcome] = {}
    for o in outcomes:
        first.setdefault(o.index, o)
    return list(first.values())


def _store_set(session: Session, job_id: int, outcomes: list[Outcome]) -> list[Outcome]:
    """One UPDATE over the outcomes, given as one JSON document of rows (each value as the
    text its column's type reads, so every value arrives as exactly as the ORM would store
    it): the outcomes of pending items, written. Its text is the same for any number of
    outcomes, so the connection prepares it once; one text parameter is encoded in C, where
    an array per column cost the driver's Python a pass over every value."""
    rows = [[o.index, *(text(r[c]) for c, text in _AS_TEXT.items())]
            for o, r in ((o, o.row()) for o in outcomes)]
    params = {"job_id": job_id, "lo": min(o.index for o in outcomes),
              "hi": max(o.index for o in outcomes), "pending": PENDING,
              "rows": json.dumps(rows, ensure_ascii=False)}
    # the driver's own execute: SQLAlchemy's bind processing cost more than the statement
    # (docs/benchmarks.md#2026-12-04-the-admission)
    done = {i for (i,) in session.connection().exec_driver_sql(_set_update(), params)}
    return [o for o in outcomes if o.index in done]


def _as_text(column: str) -> Callable[[Any], str | None]:
    """How an outcome column's value travels in _store_set's document: JSON columns as
    their JSON text (None as JSON's null, as the ORM stores it), times in ISO 8601, floats
    by repr (exact, NaN and infinities included), the rest as JSON has them."""
    kind = Item.__table__.c[column].type
    if isinstance(kind, JSON):
        return json.dumps
    if isinstance(kind, DateTime):
        return lambda v: None if v is None else v.isoformat()
    if isinstance(kind, Float):
        return lambda v: None if v is None else repr(float(v))
    return lambda v: v


_AS_TEXT = {c: _as_text(c) for c in OUTCOME_COLUMNS}


@functools.cache
def _set_update() -> str:
    """UPDATE items FROM the rows of a JSON document: PostgreSQL's, in the driver's
    parameter style (psycopg: %(name)s). Each value is read from its text by its column's
    type, as an array's elements were."""
    from sqlalchemy.dialects import postgresql

    def pg_type(c: str) -> str:
        return str(Item.__table__.c[c].type.compile(dialect=postgresql.dialect()))

    columns = ", ".join(f"CAST(e->>{k} AS {pg_type(c)}) AS {c}"
                        for k, c in enumerate(OUTCOME_COLUMNS, start=1))
    sets = ", ".join(f"{c} = given.{c}" for c in OUTCOME_COLUMNS)
    return (
        f"UPDATE items SET writes = items.writes + 1, launch = NULL, {sets} "
        f"FROM (SELECT CAST(e->>0 AS INTEGER) AS b_index, {columns} "
        "FROM json_array_elements(CAST(%(rows)s AS json)) AS e) AS given "
        "WHERE items.job_id = %(job_id)s AND items.index >= %(lo)s AND items.index <= %(hi)s "
        "AND items.index = given.b_index AND items.status = %(pending)s "
        "RETURNING items.index")


def _store_each(session: Session, job_id: int, outcomes: list[Outcome]) -> list[Outcome]:
    """The pending items among the outcomes' (locked where the database can), updated one
    statement each: the outcomes written."""
    indices = [o.index for o in outcomes]
    pending = set(session.scalars(
        select(Item.index).where(Item.job_id == job_id, *_among(indices),
                                 Item.status == PENDING).with_for_update()
    ))
    written = [o for o in outcomes if o.index in pending]
    if not written:
        return []
    table = Item.__table__
    stmt = (
        update(table)
        .where(table.c.job_id == job_id, table.c.index == bindparam("b_index"),
               table.c.status == PENDING)
        .values(writes=table.c.writes + 1, launch=None,
                **{c: bindparam(c) for c in OUTCOME_COLUMNS})
    )
    session.execute(stmt, [{"b_index": o.index, **o.row()} for o in written])
    return written


def _among(indices: list[int]) -> tuple[Any, ...]:
    """Item.index in ``indices``, with their range spelled out: PostgreSQL reads an IN
    list on an index's last column as a filter, the range as the index's bounds."""
    return (Item.index >= min(indices), Item.index <= max(indices), Item.index.in_(indices))


def record_failures(session: Session, *, job_id: int, start: int, indices: list[int],
                    error: str, launch: str | None = None) -> int:
    """An engine exception struck these pending items: one more attempt each, and its error
    (kept as the item's last error while it stays pending); their mark of ``launch`` is
    cleared (a later launch's mark stays). The fault is counted on the chunk at ``start``.
    Returns how many were pending."""
    error = storable(error)[:10000]
    chunks.add_fault(session, job_id=job_id, start=start, error=error)
    if not indices:
        return 0
    return changed(session.execute(
        update(Item)
        .where(Item.job_id == job_id, *_among(indices), Item.status == PENDING)
        .values(attempts=Item.attempts + 1, error=error,
                launch=case((Item.launch == launch, None), else_=Item.launch)),
        execution_options={"synchronize_session": False},
    ))


def mark_launch(session: Session, *, job_id: int, indices: list[int], launch: str,
                finished: Collection[int] = ()) -> None:
    """These pending items join a batch of the engine run ``launch`` (a worker's run of a
    chunk, and its generation within it). Committed before the batch's work starts: the
    mark outlives the worker, so the run after a death knows who was in flight.

    ``finished``: items of the run that finished but whose outcomes are not written yet;
    their marks are cleared in the same statement, so a death in the batch that starts
    blames none of them (they are generated again, uncharged). On PostgreSQL the mark is
    committed without waiting for its WAL flush (synchronous_commit off, this transaction
    only): it must outlive the worker, which a commit does at once, not the database
    server; the outcomes' commits keep waiting for theirs."""
    if not indices and not finished:
        return
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL synchronous_commit TO OFF"))
    marked = set(indices)
    touched = sorted(marked.union(finished))
    session.execute(
        update(Item).where(Item.job_id == job_id, *_among(touched), Item.status == PENDING)
        .values(launch=case((Item.index.in_(sorted(marked)), launch), else_=None)
                if marked else None),
        execution_options={"synchronize_session": False},
    )


def mark_launch_held(session: Session | Connection, *, job_id: int, start: int, owner: str,
                     indices: list[int], launch: str, finished: Collection[int] = ()) -> bool:
    """mark_launch, if ``owner`` holds a live lease on the chunk at ``start`` (db/chunks.py:
    holds, its row locked for share); whether it held. On PostgreSQL one statement finds
    the lease, marks, and lets the commit skip its WAL flush (a launch waits on it on the
    engine's thread, once per batch): given a connection in autocommit mode, the statement
    is its own transaction and the launch one round trip. Elsewhere ``session`` is a
    Session."""
    dialect = session.dialect if isinstance(session, Connection) else session.get_bind().dialect
    if dialect.name != "postgresql":
        assert isinstance(session, Session), "a launch off PostgreSQL takes a Session"
        if not chunks.holds(session, job_id=job_id, start=start, owner=owner, live=True):
            return False
        mark_launch(session, job_id=job_id, indices=indices, launch=launch, finished=finished)
        return True
    touched = sorted(set(indices).union(finished))
    if not touched:
        return chunks.holds(session, job_id=job_id, start=start, owner=owner, live=True)
    return bool(session.execute(_HELD_LAUNCH, {
        "job_id": job_id, "start": start, "owner": owner, "launch": launch,
        "marked": sorted(set(indices)), "touched": touched, "lo": touched[0],
        "hi": touched[-1], "pending": PENDING}).scalar())


# mark_launch_held on PostgreSQL; its text is one for any items, so it is prepared once
_HELD_LAUNCH = text(
    "WITH held AS (SELECT chunks.start FROM chunks WHERE chunks.job_id = :job_id "
    "AND chunks.start = :start AND chunks.lease_owner = :owner "
    "AND chunks.lease_until > EXTRACT(EPOCH FROM clock_timestamp())::float8 FOR SHARE), "
    "marked AS (UPDATE items SET launch = CASE WHEN items.index = "
    "ANY(CAST(:marked AS INTEGER[])) THEN CAST(:launch AS VARCHAR) END "
    "WHERE items.job_id = :job_id AND items.index >= :lo AND items.index <= :hi "
    "AND items.index = ANY(CAST(:touched AS INTEGER[])) AND items.status = :pending "
    "AND EXISTS (SELECT 1 FROM held) RETURNING 1) "
    "SELECT EXISTS (SELECT 1 FROM held), (SELECT count(*) FROM marked), "
    "set_config('synchronous_commit', 'off', true)")


def clear_launches(session: Session, *, job_id: int, start: int, end: int,
                   owner: str) -> int:
    """Clear the chunk's launch marks of ``owner``'s run (launch marks read OWNER#GENERATION):
    its items in flight are released, not charged, when the run stops alive (a lost
    lease, a run that gave its lease up, a cancelled job). Returns how many."""
    return changed(session.execute(
        update(Item)
        .where(Item.job_id == job_id, Item.index >= start, Item.index < end,
               Item.status == PENDING,
               Item.launch.startswith(owner[-200:] + "#", autoescape=True))
        .values(launch=None),
        execution_options={"synchronize_session": False},
    ))


def launch_mark(owner: str, generation: int) -> str:
    """The mark of one engine generation of a run of ``owner``: unique to it (the owner
    ends in a unique token)."""
    return f"{owner[-200:]}#{generation}"


def mark_owner(launch: str) -> str:
    """The owner a launch mark names (as marks keep it: its last 200 characters)."""
    return launch.rsplit("#", 1)[0]


def record_crash(session: Session, *, job_id: int, start: int, indices: list[int],
                 why: str, attempt: bool = True) -> list[tuple[int, int, int]]:
    """A worker died (killed, crashed, its device lost) with these pending items in its
    batch. Each counts a crash and keeps an error that says how many; alone in the batch,
    the item was the cause beyond doubt, and it counts an attempt too (an item fails for
    good at max_attempts: worker/attempts.py), unless ``attempt`` is False (the death is not
    proven: worker/run.py). Their launch marks are cleared and the fault is counted on the
    chunk. Returns (index, crashes, attempts) of each, after."""
    why = storable(why)
    chunks.add_fault(session, job_id=job_id, start=start,
                     error=f"worker died with items {_listed(indices)} in flight: {why}")
    rows = session.execute(
        select(Item.index, Item.crashes, Item.attempts)
        .where(Item.job_id == job_id, *_among(indices), Item.status == PENDING)
        .with_for_update()
    ).all() if indices else []
    alone = len(rows) == 1
    charged = alone and attempt
    out = []
    for index, crashes, attempts in rows:
        crashes, attempts = crashes + 1, attempts + charged
        company = "alone in its batch" if alone else f"with {len(rows) - 1} others in its batch"
        times = f"{crashes} time{'s' * (crashes > 1)}"
        error = f"killed or crashed its worker {times} (last {company}: {why})"
        session.execute(
            update(Item).where(Item.job_id == job_id, Item.index == index)
            .values(crashes=crashes, attempts=attempts, error=error[:10000], launch=None),
            execution_options={"synchronize_session": False},
        )
        out.append((index, crashes, attempts))
    return out


def died_in_flight(session: Session, *, job_id: int, start: int, end: int
                   ) -> dict[str, list[int]]:
    """The chunk's pending items still marked by a launch, by launch: a run opening the
    chunk finds the batches that were in flight when an earlier run's worker died."""
    rows = session.execute(
        select(Item.launch, Item.index)
        .where(Item.job_id == job_id, Item.index >= start, Item.index < end,
               Item.status == PENDING, Item.launch.is_not(None))
        .order_by(Item.index)
    ).all()
    batches: dict[str, list[int]] = {}
    for launch, index in rows:
        batches.setdefault(cast(str, launch), []).append(index)  # launch IS NOT NULL
    return batches


def _listed(indices: list[int], most: int = 8) -> str:
    """Item indices for a message: the first few, and how many more."""
    shown = ", ".join(map(str, indices[:most]))
    return f"[{shown}{f', ... {len(indices) - most} more' if len(indices) > most else ''}]"


def retry_failed(session: Session, *, job_id: int) -> list[int]:
    """Send a job's failed items back to pending (their attempts kept, their retries
    counted) and reopen the job. Returns their indices. Takes the job's lock."""
    job = lock_job(session, job_id=job_id)
    if job is None:
        raise NotFound(f"job {job_id}: not found")
    status = JobStatus(job.status)
    if status in (JobStatus.cancelling, JobStatus.cancelled):
        raise ValueError(f"job {job_id} is {status.value}: its items are not retried")
    indices = list(session.scalars(
        select(Item.index).where(Item.job_id == job_id,
                                 Item.status == ItemStatus.failed.value).order_by(Item.index)
    ))
    if not indices:
        return []
    # an item's counters start again with its new attempts (its chunk's sums follow)
    session.execute(
        update(Item)
        .where(Item.job_id == job_id, Item.status == ItemStatus.failed.value)
        .values(status=PENDING, retries=Item.retries + 1, writes=0, output=None,
                token_ids=None, finish_reason=None, started_at=None, finished_at=None,
                worker=None, **dict.fromkeys(OUTCOME_COUNTERS)),
        execution_options={"synchronize_session": False},
    )
    chunks.resum(session, job_id=job_id,
                 starts=[r.start for r in chunks.containing(session, job_id=job_id,
                                                            indices=indices)])
    if status.finished or status == JobStatus.in_progress:
        reopened = JobStatus.in_progress if job.started_at else JobStatus.queued
        session.execute(update(Job).where(Job.id == job_id)
                        .values(status=reopened.value, finished_at=None, error=None))
    return indices


def unsettled_jobs(
    session: Session, *, queue_prefix: str | None = None, job_id: int | None = None
) -> list[int]:
    """Unfinished jobs none of whose items is pending (their last writer died before
    settling them): settle_job ends them. With ``queue_prefix``, only that deployment's
    jobs and those run in a process of their own (no queue: no deployment's); another
    deployment's are its reconciler's. With ``job_id``, that job only."""
    pending = select(Item.index).where(Item.job_id == Job.id, Item.status == PENDING)
    stmt = select(Job.id).where(Job.status.in_(RUNNING), ~pending.exists())
    if queue_prefix is not None:
        stmt = stmt.where(or_(Job.queue.is_(None), chunks.deployment(queue_prefix)))
    if job_id is not None:
        stmt = stmt.where(Job.id == job_id)
    return list(session.scalars(stmt))


def cancel_pending(
    session: Session, *, job_id: int, start: int | None = None, end: int | None = None
) -> int:
    """Mark pending items (of one chunk, or all) cancelled. Call under lock_job."""
    stmt = update(Item).where(Item.job_id == job_id, Item.status == PENDING)
    if start is not None and end is not None:
        stmt = stmt.where(Item.index >= start, Item.index < end)
    result = session.execute(
        stmt.values(status=ItemStatus.cancelled.value, finished_at=utcnow()),
        execution_options={"synchronize_session": False},
    )
    chunks.recount(session, job_id=job_id, start=start)
    return changed(result)


def status_counts(session: Session, *, job_id: int) -> dict[str, int]:
    """Item count per ItemStatus value (every status present, zeros included), added up
    from the job's chunks (db/chunks.py keeps their counts with every change of their
    items): a few thousand rows for a million items. A job with no chunks (stored by hand)
    has its items counted."""
    c = Chunk.__table__.c
    total, n, completed, failed, cancelled = session.execute(
        select(Job.total, func.count(c.start), func.sum(c.completed), func.sum(c.failed),
               func.sum(c.cancelled))
        .select_from(Job).outerjoin(Chunk.__table__, c.job_id == Job.id)
        .where(Job.id == job_id).group_by(Job.id, Job.total)
    ).one_or_none() or (0, 0, 0, 0, 0)
    if not n:
        return count_items(session, job_id=job_id)
    counts = {ItemStatus.completed.value: int(completed or 0),
              ItemStatus.failed.value: int(failed or 0),
              ItemStatus.cancelled.value: int(cancelled or 0)}
    return {ItemStatus.pending.value: total - sum(counts.values()), **counts}


def count_items(session: Session, *, job_id: int) -> dict[str, int]:
    """status_counts by counting the job's items themselves."""
    counts = {s.value: 0 for s in ItemStatus}
    rows = session.execute(
        select(Item.status, func.count()).where(Item.job_id == job_id).group_by(Item.status)
    )
    counts.update({status: n for status, n in rows})
    return counts


def settle_job(session: Session, *, job_id: int) -> JobStatus:
    """Derive the job's end from its items: once none is pending, a queued or in-progress
    job is completed and a cancelling one cancelled. Returns the job's status.

    One conditional UPDATE, no lock: call it after the transaction that wrote the caller's
    items committed. Of two workers writing a job's last items at once, the later to
    settle then sees both writes (a statement sees every commit before it). A settling that
    is missed anyway (a worker killed in between) is the reconciler's: unsettled_jobs.
    """
    pending = select(Item.index).where(Item.job_id == job_id, Item.status == PENDING).exists()
    ends = case((Job.status == JobStatus.cancelling.value, JobStatus.cancelled.value),
                else_=JobStatus.completed.value)
    ended = changed(session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(RUNNING), ~pending)
        .values(status=ends, finished_at=utcnow())
        .execution_options(synchronize_session=False)
    ))
    if ended:  # this call ended it: its events, in this transaction
        webhooks.job_ended(session, job_id=job_id)
    return JobStatus(session.scalar(select(Job.status).where(Job.id == job_id)))


def request_cancel(session: Session, *, job_id: int) -> JobStatus:
    """Cancel a job: a queued job (no chunk started) ends at once; a running one becomes
    cancelling: the items of chunks not sent yet are cancelled now, and each worker
    cancels its chunk's items at the chunk's start."""
    job = lock_job(session, job_id=job_id)
    if job is None:
        raise NotFound(f"job {job_id}: not found")
    status = JobStatus(job.status)
    if status in (JobStatus.validating, JobStatus.queued):
        cancel_pending(session, job_id=job_id)
        set_job_status(session, job_id=job_id, status=JobStatus.cancelled)
        return JobStatus.cancelled
    if status == JobStatus.in_progress:
        set_job_status(session, job_id=job_id, status=JobStatus.cancelling)
        chunks.cancel_unsent(session, job_id=job_id)
        return settle_job(session, job_id=job_id)
    return status


def iter_items(
    session: Session, *, job_id: int, batch: int = 1000, columns: Sequence[str] | None = None
) -> Iterator[Any]:
    """Every item of the job in index order, streamed (server-side cursor where there is one):
    Item objects, or with ``columns`` rows of those columns only, to unpack as tuples (no
    ORM object per item: what exports of a million items read, several times faster)."""
    table = Item.__table__
    what = select(Item) if columns is None else select(*(table.c[c] for c in columns))
    stmt = (
        what.where(table.c.job_id == job_id).order_by(table.c.index)
        .execution_options(yield_per=batch)
    )
    if columns is None:
        yield from session.scalars(stmt)
    else:
        for part in session.execute(stmt).partitions():
            yield from part


def job_figures(session: Session, *, job_ids: list[int]) -> list[RowMapping]:
    """The job_metrics rows (db/views.py) of these jobs, newest first, in one query."""
    if not job_ids:
        return []
    view = views.job_metrics
    stmt = select(view).where(view.c.job_id.in_(job_ids)).order_by(view.c.job_id.desc())
    return list(session.execute(stmt).mappings())


def latest_job_ids(session: Session, *, limit: int = 50, schedule: str | None = None) -> list[int]:
    """Ids of the latest jobs, newest first; only those one beat schedule fired if
    ``schedule``."""
    stmt = select(Job.id).order_by(Job.id.desc()).limit(limit)
    if schedule is not None:
        stmt = stmt.where(Job.schedule == schedule)
    return list(session.scalars(stmt))


def _by_element(session: Session, stmt: Any) -> list[int]:
    """[(pos, n)] rows, pos from 0 → a list with n at pos (0 where no row says)."""
    rows = session.execute(stmt).all()
    out = [0] * (max((pos for pos, _ in rows), default=-1) + 1)
    for pos, n in rows:
        out[pos] = int(n)
    return out


def accepted_by_position(session: Session, *, job_id: int) -> list[int]:
    """Draft tokens accepted at each draft slot ([0]: the first), summed over the job's
    items (the view job_acceptance_by_position)."""
    view = views.job_acceptance_by_position
    return _by_element(session, select(view.c.draft_position - 1, view.c.accepted)
                       .where(view.c.job_id == job_id))


def steps_by_draft_length(session: Session, *, job_id: int) -> list[int]:
    """[g]: engine steps the job's items ran at draft length g (the view
    job_steps_by_draft_length)."""
    view = views.job_steps_by_draft_length
    return _by_element(session, select(view.c.draft_length, view.c.steps)
                       .where(view.c.job_id == job_id))


def steps_by_drafts_verified(session: Session, *, job_id: int) -> list[int]:
    """[n]: steps in which one of the job's items verified n draft tokens, the grammar's
    included (the view job_steps_by_drafts_verified)."""
    view = views.job_steps_by_drafts_verified
    return _by_element(session, select(view.c.drafts_verified, view.c.steps)
                       .where(view.c.job_id == job_id))


def chunk_timeline(session: Session, *, job_id: int) -> list[tuple[Any, Any, int, list[int]]]:
    """(first start, last finish, new tokens, steps_by_draft_length) of the job's chunks with
    written items, in finishing order: a timeline at the grain of chunks (draft length and
    throughput over time), read from a few thousand rows for a million items."""
    stmt = (
        select(Chunk.first_started, Chunk.last_finished, Chunk.__table__.c.new_tokens,
               Chunk.__table__.c.steps_by_draft_length)
        .where(Chunk.job_id == job_id, Chunk.last_finished.is_not(None))
        .order_by(Chunk.last_finished, Chunk.start)
    )
    return [(t0, t1, int(tokens or 0), list(steps or []))
            for t0, t1, tokens, steps in session.execute(stmt)]


ITEM_TIMELINE_MAX = 10_000  # items a timeline is read at the grain of (a job this small)


def item_timeline(session: Session, *, job_id: int) -> list[tuple[Any, Any, int, list[int]]]:
    """chunk_timeline's rows at the grain of items (start, finish, new tokens,
    steps_by_draft_length of each finished item, in finishing order), for a job of at most
    ITEM_TIMELINE_MAX items: one of a single chunk or a few still has a course over time."""
    c = Item.__table__.c
    stmt = (
        select(c.started_at, c.finished_at, c.new_tokens, c.steps_by_draft_length)
        .where(c.job_id == job_id, c.finished_at.is_not(None))
        .order_by(c.finished_at, c.index)
        .limit(ITEM_TIMELINE_MAX)
    )
    return [(t0, t1, int(tokens or 0), list(steps or []))
            for t0, t1, tokens, steps in session.execute(stmt)]


def elapsed(first: datetime | None, last: datetime | None) -> float | None:
    """Seconds between two stored timestamps (SQLite hands them back without a zone)."""
    if first is None or last is None:
        return None
    if (first.tzinfo is None) != (last.tzinfo is None):
        first, last = first.replace(tzinfo=None), last.replace(tzinfo=None)
    return (last - first).total_seconds()
