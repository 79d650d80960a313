"""What the retention sweep deletes, found and deleted in bounded batches. Keyword-only
functions over a Session, like db/repository.py; the sweep itself (its order, the files'
bytes, its counts) is api/retention.py.

What expires:

    an uploaded file      at its expires_at (its upload's expires_after, or the operator's
                          default retention_files): the row, its parts or its bytes
    a batch's outputs     at their expires_at, once the batch asked for one
                          (output_expires_after: its job's end plus those seconds)
    a batch's outputs     retention_outputs after its job ended: the output and error files
                          (rows; their content is the job's results, emptied with them)
    a job's results       retention_results after it ended (retention_outputs for a batch's
                          job): the items' prompts and outputs emptied, their counters kept
                          (the job's acceptance metrics outlive its texts), or with
                          retention_keep_metrics off the job, its items, chunks and batch
    a webhook delivery    retention_webhooks after it was made, once delivered or given up:
                          the row and its attempts (pending ones stay)
    a deleted file's id   DELETED_FILES_KEPT after its deletion (what places a listing's
                          cursor that names it: db/models.py DeletedFile)

Each statement changes at most ``rows`` rows and each batch is its own transaction (the
caller's), so a sweep never holds a long lock, and one stopped half-way is taken up where
it stopped by the next: a job is marked swept only once all its items are.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import delete, func, insert, or_, select, update
from sqlalchemy.orm import Session

from specq.db.models import (
    Batch,
    Chunk,
    DeletedFile,
    File,
    FilePart,
    Item,
    Job,
    JobStatus,
    WebhookAttempt,
    WebhookDelivery,
    utcnow,
)
from specq.db.session import changed

FINISHED = tuple(s.value for s in JobStatus if s.finished)
DELETED_FILES_KEPT = 7 * 86400  # seconds a deleted file's id still places a listing's cursor
TEXTS = ("prompt", "messages", "output", "token_ids")  # what emptying a job's results drops


def due_outputs(session: Session, *, limit: int) -> list[tuple[int, datetime, int]]:
    """Output and error files of finished batches that asked for an expiry
    (output_expires_after) and have no expires_at yet: (file id, its job's finished_at,
    the seconds), at most ``limit``."""
    rows = session.execute(
        select(File.id, Job.finished_at, Batch.output_expires_after)
        .join(Batch, Batch.id == File.batch_id).join(Job, Job.id == Batch.job_id)
        .where(File.kind.in_(("output", "error")), File.expires_at.is_(None),
               Batch.output_expires_after.is_not(None), Job.finished_at.is_not(None))
        .order_by(File.id).limit(limit))
    # (NULLs excluded above)
    return cast(list[tuple[int, datetime, int]], [tuple(r) for r in rows])


def set_expiry(session: Session, *, file_id: int, expires_at: datetime) -> None:
    session.execute(update(File).where(File.id == file_id, File.expires_at.is_(None))
                    .values(expires_at=expires_at))


def expired_files(session: Session, *, now: datetime, limit: int) -> list[File]:
    """Uploaded files whose expires_at has passed, oldest first."""
    return list(session.scalars(
        select(File).where(File.expires_at.is_not(None), File.expires_at <= now)
        .order_by(File.expires_at, File.id).limit(limit)))


def known_files(session: Session, *, openai_ids: list[str]) -> set[str]:
    """Which of these file ids a row names."""
    return set(session.scalars(select(File.openai_id).where(File.openai_id.in_(openai_ids))))


def delete_files(session: Session, *, file_ids: list[int]) -> int:
    """The files' rows and the parts kept in the database, each id kept in deleted_files;
    how many rows."""
    if not file_ids:
        return 0
    session.execute(delete(FilePart).where(FilePart.file_id.in_(file_ids)))
    # the ids of the rows this statement deleted: two deletes of one file at once (a
    # client's retry) keep it once, the second finding no row once the first commits
    gone = session.execute(delete(File).where(File.id.in_(file_ids))
                           .returning(File.openai_id, File.tenant_id, File.id)).all()
    if gone:
        now = utcnow()
        session.execute(insert(DeletedFile), [
            {"openai_id": o, "tenant_id": t, "seq": i, "deleted_at": now} for o, t, i in gone])
    return len(gone)


def old_deleted_files(session: Session, *, before: datetime, limit: int) -> int:
    """Forget the ids of files deleted before ``before`` (``limit`` at most); how many."""
    ids = select(DeletedFile.openai_id).where(DeletedFile.deleted_at < before) \
        .order_by(DeletedFile.deleted_at).limit(limit)
    return changed(session.execute(delete(DeletedFile).where(DeletedFile.openai_id.in_(
        ids.scalar_subquery()))))


def _batch_jobs(before: datetime) -> Any:
    """Ids of the jobs of batches that ended before ``before``."""
    return (select(Batch.job_id).join(Job, Job.id == Batch.job_id)
            .where(Job.status.in_(FINISHED), Job.finished_at < before))


def ended_outputs(session: Session, *, before: datetime, limit: int) -> list[int]:
    """Output and error files of batches that ended before ``before`` (their job finished,
    or their file failed its checks)."""
    ended = or_(Batch.job_id.in_(_batch_jobs(before)),
                Batch.failed_at < before)
    return list(session.scalars(
        select(File.id).join(Batch, Batch.id == File.batch_id)
        .where(File.kind.in_(("output", "error")), ended).order_by(File.id).limit(limit)))


def jobs_to_sweep(session: Session, *, before: datetime | None,
                  batches_before: datetime | None, limit: int,
                  emptied_too: bool = False) -> list[int]:
    """Finished jobs not swept yet whose results are past their retention: jobs that ended
    before ``before`` (None: none by that rule), and batches' jobs that ended before
    ``batches_before`` (None: as any other job). ``emptied_too``: jobs an earlier sweep
    emptied (kept for their metrics) as well, for a sweep that deletes jobs whole."""
    rules = []
    if before is not None:
        rules.append(Job.finished_at < before)
    if batches_before is not None:
        rules.append(Job.id.in_(_batch_jobs(batches_before)))
    if not rules:
        return []
    return list(session.scalars(
        select(Job.id).where(Job.status.in_(FINISHED), or_(*rules),
                             *(() if emptied_too else (Job.swept_at.is_(None),)))
        .order_by(Job.finished_at, Job.id).limit(limit)))


def empty_items(session: Session, *, job_id: int, start: int, rows: int) -> int:
    """Drop the texts of the job's items [start, start + rows); how many were changed."""
    return changed(session.execute(
        update(Item).where(Item.job_id == job_id, Item.index >= start,
                           Item.index < start + rows)
        .values(dict.fromkeys(TEXTS)), execution_options={"synchronize_session": False}))


def delete_items(session: Session, *, job_id: int, start: int, rows: int) -> int:
    return changed(session.execute(
        delete(Item).where(Item.job_id == job_id, Item.index >= start,
                           Item.index < start + rows),
        execution_options={"synchronize_session": False}))


def last_index(session: Session, *, job_id: int) -> int:
    """The job's highest item index, -1 with none."""
    return int(session.execute(select(func.coalesce(func.max(Item.index), -1))
                               .where(Item.job_id == job_id)).scalar_one())


def outputs_of(session: Session, *, job_id: int) -> list[int]:
    """The output and error files of the job's batch: made from its items, they go with
    the items' texts (served emptied, they would pass blank answers off as its own)."""
    return list(session.scalars(
        select(File.id).join(Batch, Batch.id == File.batch_id)
        .where(Batch.job_id == job_id, File.kind.in_(("output", "error")))))


def mark_swept(session: Session, *, job_id: int, now: datetime) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(swept_at=now))


def delete_job(session: Session, *, job_id: int) -> None:
    """The job (its items deleted already), its chunks, and its batch with its files."""
    batch_ids = list(session.scalars(select(Batch.id).where(Batch.job_id == job_id)))
    if batch_ids:
        files = list(session.scalars(select(File.id).where(File.batch_id.in_(batch_ids))))
        delete_files(session, file_ids=files)
        session.execute(delete(Batch).where(Batch.id.in_(batch_ids)))
    session.execute(delete(Chunk).where(Chunk.job_id == job_id))
    session.execute(delete(Job).where(Job.id == job_id))


def old_deliveries(session: Session, *, before: float, limit: int) -> list[int]:
    """Delivered or given-up webhook deliveries made before ``before`` (seconds since the
    epoch)."""
    d = WebhookDelivery
    return list(session.scalars(
        select(d.id).where(d.status != "pending", d.created < before)
        .order_by(d.id).limit(limit)))


def delete_deliveries(session: Session, *, ids: list[int]) -> int:
    if not ids:
        return 0
    session.execute(delete(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(ids)))
    return changed(session.execute(delete(WebhookDelivery).where(WebhookDelivery.id.in_(ids))))
