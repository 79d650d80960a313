"""Files and batches of the OpenAI Batch API (api/server/), each owned by a tenant.
Keyword-only functions over a Session, like db/repository.py.

Every read takes the tenant: a file or batch of another tenant is not found, which is
what the server answers (404), so no caller can forget the check. Lists are newest first
and paged by an object's id (``after``), as OpenAI pages them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import and_, bindparam, func, or_, select, true, update
from sqlalchemy.orm import Session

from specq.db import views, webhooks
from specq.db.models import (
    Batch,
    Chunk,
    DeletedFile,
    File,
    FilePart,
    Item,
    Job,
    JobStatus,
    Tenant,
    could_be_id,
    utcnow,
)
from specq.db.session import changed

UNFINISHED = tuple(s.value for s in JobStatus if not s.finished)


def storable(text: str) -> bool:
    """Whether every database stores ``text`` as it is: no NUL (PostgreSQL refuses it in
    text) and no lone surrogate (not UTF-8)."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# -- files --------------------------------------------------------------------------------

def add_file(session: Session, **columns: Any) -> File:
    row = File(**columns)
    session.add(row)
    session.flush()
    return row


def add_part(session: Session, *, file_id: int, part: int, data: bytes) -> None:
    session.add(FilePart(file_id=file_id, part=part, data=data))
    session.flush()


def iter_parts(session: Session, *, file_id: int) -> Iterator[bytes]:
    """A file kept in the database, part by part (one part in memory at a time)."""
    parts = session.scalars(select(FilePart.part).where(FilePart.file_id == file_id)
                            .order_by(FilePart.part)).all()
    for part in parts:
        yield session.scalars(select(FilePart.data).where(FilePart.file_id == file_id,
                                                           FilePart.part == part)).one()


def _shown() -> Any:
    """The files a tenant sees: all but the error file of a batch with no failed or
    cancelled request yet (an empty error file is none; OpenAI's error_file_id is null
    then). Read from the job's chunk counts, a few rows per thousand requests."""
    has_errors = (select(Chunk.job_id).join(Batch, Batch.job_id == Chunk.job_id)
                  .where(Batch.id == File.batch_id, Chunk.failed + Chunk.cancelled > 0)
                  .exists())
    return or_(File.kind != "error", has_errors)


def get_file(session: Session, *, tenant_id: int, openai_id: str) -> File | None:
    if not could_be_id(openai_id):
        return None
    return session.scalar(select(File).where(File.openai_id == openai_id,
                                             File.tenant_id == tenant_id, _shown()))


def _page(session: Session, model: Any, *, tenant_id: int, after: str | None, limit: int,
          ascending: bool = False, where: Sequence[Any] = (), gone: Any = None
          ) -> tuple[list[Any], bool]:
    """A page of ``model`` rows of the tenant after the one whose id is ``after``, newest
    first (oldest first if ``ascending``), and whether more follow. ``gone``: where the ids
    of deleted rows are kept with their places (a cursor naming one still pages)."""
    stmt = select(model).where(model.tenant_id == tenant_id, *where)
    if after is not None:
        if not could_be_id(after):
            raise KeyError(after)
        seq = session.scalar(select(model.id).where(model.openai_id == after,
                                                    model.tenant_id == tenant_id))
        if seq is None and gone is not None:
            seq = session.scalar(select(gone.seq).where(gone.openai_id == after,
                                                        gone.tenant_id == tenant_id))
        if seq is None:
            raise KeyError(after)
        stmt = stmt.where(model.id > seq if ascending else model.id < seq)
    stmt = stmt.order_by(model.id.asc() if ascending else model.id.desc()).limit(limit + 1)
    rows = list(session.scalars(stmt))
    return rows[:limit], len(rows) > limit


def list_files(session: Session, *, tenant_id: int, after: str | None, limit: int,
               ascending: bool = False, purpose: str | None = None) -> tuple[list[File], bool]:
    where = [_shown()] + ([] if purpose is None else [File.purpose == purpose])
    return _page(session, File, tenant_id=tenant_id, after=after, limit=limit,
                 ascending=ascending, where=where, gone=DeletedFile)


def set_file_bytes(session: Session, *, file_id: int, size: int,
                   created_at: datetime | None = None) -> None:
    """An output or error file made whole: its size, and its ``created_at`` (its batch's end,
    where OpenAI makes the file; the row was made with the batch, for partial downloads)."""
    values: dict[str, Any] = {"bytes": size}
    if created_at is not None:
        values["created_at"] = created_at
    session.execute(update(File).where(File.id == file_id).values(**values))


# -- batches ------------------------------------------------------------------------------

def add_batch(session: Session, **columns: Any) -> Batch:
    row = Batch(**columns)
    session.add(row)
    session.flush()
    return row


def get_batch(session: Session, *, tenant_id: int, openai_id: str) -> Batch | None:
    if not could_be_id(openai_id):
        return None
    return session.execute(
        select(Batch).where(Batch.openai_id == openai_id, Batch.tenant_id == tenant_id)
        .execution_options(populate_existing=True)).scalar_one_or_none()


# the columns of its job's job_metrics row (db/views.py) that a Batch object shows
SHOWN_FIGURES = ("job_id", "status", "pair", "drafter", "finished_at", "total", "completed",
                 "failed", "cancelled", "pending", "prompt_tokens", "new_tokens",
                 "acceptance_rate", "mean_acceptance_length", "tokens_per_second",
                 "engine_tokens_per_second", "estimated_speedup")


@dataclass(frozen=True)
class BatchRead:
    """A batch with all that its Batch object shows, read in one statement (`read_batches`).

    ``figures``: its job's job_metrics columns SHOWN_FIGURES (None before its job);
    ``output_id``, ``error_id``: its output and error files' ids; ``lines``: the requests
    in its input file (None once that file is deleted)."""

    batch: Batch
    figures: dict[str, Any] | None
    output_id: str | None
    error_id: str | None
    lines: int | None


def read_batches(session: Session, *, tenant_id: int, openai_id: str | None = None,
                 batch_ids: Sequence[int] = ()) -> list[BatchRead]:
    """The tenant's batch ``openai_id`` (or those of ``batch_ids``, newest first), each
    with its job's figures, its files and its input's line count: one statement, so one
    snapshot and one round trip however busy the job (_read_statement)."""
    if openai_id is not None and not could_be_id(openai_id):
        return []
    one = openai_id is not None
    stmt = _read_statement(session.get_bind().dialect.name, one)
    params: dict[str, Any] = {"tenant_id": tenant_id}
    if one:
        params["openai_id"] = openai_id
    else:
        params["batch_ids"] = list(batch_ids)
    out = []
    for row in session.execute(stmt, params):
        batch, *values, output_id, error_id, n = row
        job = dict(zip(SHOWN_FIGURES, values, strict=True))
        out.append(BatchRead(batch, job if job["job_id"] is not None else None, output_id,
                             error_id, n))
    return out


@functools.cache
def _read_statement(dialect: str, one: bool) -> Any:
    """read_batches' statement, built once (a GET polls it: building its subqueries cost
    more than running it); ``one``: by openai_id, else by the ids in ``batch_ids``. The
    job's figures are summed from its chunks (a few rows per thousand requests), on
    PostgreSQL in a LATERAL subquery fenced by OFFSET 0, so that it sums only that job's
    chunks (unfenced, it would sum every job's and join after)."""
    view = views.job_metrics
    shown = select(*(view.c[name] for name in SHOWN_FIGURES))
    figures: Any
    if dialect == "postgresql":
        figures = shown.where(view.c.job_id == Batch.job_id).offset(0).lateral("figures")
        on = true()
    else:  # SQLite has no LATERAL (nor a fleet's tables)
        figures = shown.subquery("figures")
        on = figures.c.job_id == Batch.job_id

    def file_of(kind: str) -> Any:  # (files.batch_id has no index; the tenant's has)
        return (select(File.openai_id).where(File.tenant_id == Batch.tenant_id,
                                             File.batch_id == Batch.id, File.kind == kind)
                .limit(1).scalar_subquery())

    lines = (select(File.lines).where(File.tenant_id == Batch.tenant_id,
                                      File.openai_id == Batch.input_file_id)
             .scalar_subquery())
    stmt = (select(Batch, *figures.c, file_of("output"), file_of("error"), lines)
            .outerjoin(figures, on).where(Batch.tenant_id == bindparam("tenant_id")))
    if one:
        stmt = stmt.where(Batch.openai_id == bindparam("openai_id"))
    else:
        stmt = stmt.where(Batch.id.in_(bindparam("batch_ids", expanding=True)))
    return stmt.order_by(Batch.id.desc())


def by_idempotency_key(session: Session, *, tenant_id: int, key: str) -> Batch | None:
    return session.scalar(select(Batch).where(Batch.tenant_id == tenant_id,
                                              Batch.idempotency_key == key))


def list_batches(session: Session, *, tenant_id: int, after: str | None, limit: int
                 ) -> tuple[list[Batch], bool]:
    return _page(session, Batch, tenant_id=tenant_id, after=after, limit=limit)


def attach_job(session: Session, *, batch_id: int, job_id: int) -> bool:
    """Give a validating batch its job; False if the batch is no longer validating (failed
    by `fail_stale` meanwhile): the caller rolls the job back."""
    if not changed(session.execute(
            update(Batch).where(Batch.id == batch_id, Batch.status == "validating",
                                Batch.job_id.is_(None))
            .values(job_id=job_id, status="submitted", in_progress_at=utcnow()))):
        return False
    # a job that ended before its batch knew it (a small job, quick workers): the batch's
    # event now, since the job's end found no batch to announce
    webhooks.job_ended(session, job_id=job_id, batch_only=True)
    return True


def fail_batch(session: Session, *, batch_id: int, errors: list[dict[str, Any]],
               release_key: bool = False) -> None:
    """The batch failed; ``release_key``: its Idempotency-Key is freed, so that a retry
    with it makes a new batch (a failure of the server's, not of the request)."""
    values: dict[str, Any] = {"status": "failed", "errors": errors, "failed_at": utcnow()}
    if release_key:
        values["idempotency_key"] = None
    if changed(session.execute(update(Batch).where(Batch.id == batch_id,
                                                   Batch.job_id.is_(None)).values(values))):
        webhooks.batch_failed(session, batch_id=batch_id)  # its event, in this transaction


def cancel_validating(session: Session, *, batch_id: int) -> bool:
    """Cancel a batch still validating, before its job is stored: it ends cancelled with no
    job, and its create, if it is still running, finds it no longer validating and rolls
    its job back (`attach_job`). False if its job was attached first (then the job is the
    one to cancel). Writes the batch.cancelled event in this transaction."""
    now = utcnow()
    if not changed(session.execute(
            update(Batch).where(Batch.id == batch_id, Batch.status == "validating",
                                Batch.job_id.is_(None))
            .values(status="cancelled", cancelling_at=now))):
        return False
    webhooks.batch_ended_without_job(session, batch_id=batch_id, status="cancelled")
    return True


STUCK = [{"code": "batch_not_created", "line": None, "param": None,
          "message": "the server stopped before this batch's job was stored; nothing of it "
                     "runs. Create it again (the same Idempotency-Key makes a new batch)."}]


def fail_stale(session: Session, *, before: datetime, batch_id: int | None = None) -> int:
    """Fail the batches still validating, with no job, made before ``before`` (a create
    whose server died before its job was committed: the job and the batch's link are one
    transaction, so none was). Their Idempotency-Keys are freed, and each one's
    batch.failed event is written. How many."""
    stmt = update(Batch).where(Batch.status == "validating", Batch.job_id.is_(None),
                               Batch.created_at < before)
    if batch_id is not None:
        stmt = stmt.where(Batch.id == batch_id)
    failed = session.scalars(stmt.values(status="failed", errors=STUCK, failed_at=utcnow(),
                                         idempotency_key=None)
                             .returning(Batch.id)).all()
    for failed_id in failed:
        webhooks.batch_failed(session, batch_id=failed_id)
    return len(failed)


def mark(session: Session, *, batch_id: int, column: str) -> bool:
    """Set the batch's time ``column`` (cancelling_at, expired_at) unless it is set;
    whether this call set it."""
    col = getattr(Batch, column)
    return bool(changed(session.execute(update(Batch).where(Batch.id == batch_id, col.is_(None))
                                        .values({column: utcnow()}))))


def lock_tenant(session: Session, tenant_id: int) -> None:
    """Hold the tenant's row till the transaction ends: the tenant's creates that check
    its quota go one at a time (a write, so SQLite takes its lock before any read too)."""
    session.execute(update(Tenant).where(Tenant.id == tenant_id).values(name=Tenant.name))


def unfinished_items(session: Session, *, tenant_id: int) -> int:
    """Requests of the tenant's batches whose job is not finished and that have no outcome
    yet (from the chunks' counts: a few rows per thousand items), and of its batches still
    validating (their job not stored yet: their input files' lines)."""
    # one statement, so one snapshot: counted in two, a create committing its job between
    # them was in neither (its batch no longer validating, its job not yet seen), and
    # creates at the same moment passed the quota together
    validating = (select(func.coalesce(func.sum(File.lines), 0))
                  .select_from(Batch).join(File, File.openai_id == Batch.input_file_id)
                  .where(Batch.tenant_id == tenant_id, Batch.status == "validating",
                         Batch.job_id.is_(None)).scalar_subquery())
    return int(session.execute(select(_unfinished_jobs(tenant_id) + validating)).scalar_one())


def _unfinished_jobs(tenant_id: int) -> Any:
    """The tenant's batches' requests that have no outcome yet, as a scalar subquery."""
    c = Chunk.__table__.c
    done = func.coalesce(func.sum(c.completed + c.failed + c.cancelled), 0)
    jobs = (select(Job.id.label("job_id"), Job.total.label("total"), done.label("done"))
            .select_from(Batch).join(Job, Job.id == Batch.job_id)
            .outerjoin(Chunk.__table__, c.job_id == Job.id)
            .where(Batch.tenant_id == tenant_id, Job.status.in_(UNFINISHED))
            .group_by(Job.id, Job.total).subquery())
    return select(func.coalesce(func.sum(jobs.c.total - jobs.c.done), 0)).scalar_subquery()


def overdue(session: Session, *, now: datetime | None = None) -> list[tuple[int, int]]:
    """(batch id, job id) of the batches past their completion window whose job is not
    finished and that were not expired yet."""
    return [(batch_id, job_id) for batch_id, job_id in session.execute(
        select(Batch.id, Job.id).join(Job, Job.id == Batch.job_id)
        .where(Batch.expires_at < (now or utcnow()), Batch.expired_at.is_(None),
               Job.status.in_(UNFINISHED)))]


def job_tenants(session: Session, *, job_ids: Iterable[int]) -> dict[int, str]:
    """The tenant of each job made through the HTTP door (the others have none)."""
    ids = list(job_ids)
    if not ids:
        return {}
    rows = session.execute(select(Batch.job_id, Tenant.name)
                           .join(Tenant, Tenant.id == Batch.tenant_id)
                           .where(Batch.job_id.in_(ids)))
    return {cast(int, job_id): name for job_id, name in rows}  # job_id IN ids


def iter_outcomes(session: Session, *, job_id: int, statuses: Sequence[str],
                  columns: Sequence[str], batch: int = 1000) -> Iterator[Any]:
    """The job's items of these statuses in index order, rows of ``columns``, streamed
    (a server-side cursor where there is one)."""
    table = Item.__table__
    stmt = (select(*(table.c[c] for c in columns))
            .where(and_(table.c.job_id == job_id, table.c.status.in_(list(statuses))))
            .order_by(table.c.index).execution_options(yield_per=batch))
    for part in session.execute(stmt).partitions():
        yield from part
