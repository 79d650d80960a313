"""The retention sweep: expired uploads, old batches' outputs and old jobs' results deleted,
in bounded batches (db/retention.py says what expires when). `specq sweep` runs one pass,
or one every ``--every`` seconds; nothing expires unless an upload names expires_after or
the operator sets a retention (SPECQ_RETENTION_*).

A file's row goes first, its bytes after the row's deletion commits: a sweep stopped in
between leaves bytes no row names, never a row whose bytes are gone; each sweep deletes the
directory store's bytes that no row names once they are an hour old (logging each), as it
does an upload's whose server died before its row committed. What a pass swept is
logged, returned, and added to the deployment's counts on the broker, which the exporter
serves (specq_retention_swept_total{what}).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

import redis
from sqlalchemy.orm import Session, sessionmaker

from specq.broker import connection
from specq.configs.settings import Settings
from specq.db import retention
from specq.db.models import as_utc, utcnow
from specq.db.session import session_factory

log = logging.getLogger(__name__)


@dataclass
class SweepReport:
    files: int = 0  # uploaded files deleted
    file_bytes: int = 0  # their size
    outputs: int = 0  # batches' output and error files deleted
    jobs_emptied: int = 0  # jobs whose items' texts were dropped (counters kept)
    items_emptied: int = 0
    jobs_deleted: int = 0  # jobs deleted whole (retention_keep_metrics off)
    items_deleted: int = 0
    deliveries: int = 0  # webhook deliveries made or given up, with their attempts

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


WHAT = tuple(SweepReport.__dataclass_fields__)


def swept_key(settings: Settings) -> str:
    return f"{settings.queue_prefix}:retention-swept"


def sweep(settings: Settings, *, sessions: sessionmaker[Session] | None = None,
          now: datetime | None = None) -> SweepReport:
    """One pass at ``now`` (default: the time now): every expired thing, a batch of
    ``retention_sweep_rows`` rows per transaction."""
    sessions = sessions or session_factory(settings.sqlalchemy_url)
    now = now or utcnow()
    rows = settings.retention_sweep_rows
    report = SweepReport()
    while True:  # finished batches' outputs that asked for an expiry get their expires_at
        with sessions.begin() as s:
            due = retention.due_outputs(s, limit=rows)
            for file_id, finished, seconds in due:
                retention.set_expiry(s, file_id=file_id,
                                     expires_at=output_expiry(finished, seconds))
        if len(due) < rows:
            break
    while True:
        with sessions.begin() as s:
            found = retention.expired_files(s, now=now, limit=rows)
            retention.delete_files(s, file_ids=[f.id for f in found])
        for f in found:
            if f.kind == "input" and f.stored_in == "directory":
                _unlink(settings, f.openai_id)
        uploads = [f for f in found if f.kind == "input"]
        report.files += len(uploads)
        report.file_bytes += sum(f.bytes or 0 for f in uploads)
        report.outputs += len(found) - len(uploads)  # a batch's, by its output_expires_after
        if len(found) < rows:
            break
    _reap_strays(settings, sessions)
    outputs_before = (None if settings.retention_outputs is None
                      else now - timedelta(seconds=settings.retention_outputs))
    results_before = (None if settings.retention_results is None
                      else now - timedelta(seconds=settings.retention_results))
    while outputs_before is not None:
        with sessions.begin() as s:
            ids = retention.ended_outputs(s, before=outputs_before, limit=rows)
            report.outputs += retention.delete_files(s, file_ids=ids)
        if len(ids) < rows:
            break
    while True:
        with sessions() as s:
            jobs = retention.jobs_to_sweep(s, before=results_before,
                                           batches_before=outputs_before, limit=rows,
                                           emptied_too=not settings.retention_keep_metrics)
        for job_id in jobs:
            _sweep_job(settings, sessions, job_id, now, report)
        if len(jobs) < rows:
            break
    forget_before = now - timedelta(seconds=retention.DELETED_FILES_KEPT)
    while True:  # ids of files deleted long ago: no listing's cursor names them any more
        with sessions.begin() as s:
            forgotten = retention.old_deleted_files(s, before=forget_before, limit=rows)
        if forgotten < rows:
            break
    while settings.retention_webhooks is not None:
        with sessions.begin() as s:
            ids = retention.old_deliveries(
                s, before=now.timestamp() - settings.retention_webhooks, limit=rows)
            report.deliveries += retention.delete_deliveries(s, ids=ids)
        if len(ids) < rows:
            break
    if any(asdict(report).values()):
        log.info("retention sweep: %s", ", ".join(f"{k} {v}" for k, v in asdict(report).items()
                                                   if v))
        count_swept(settings, report)
    return report


def _sweep_job(settings: Settings, sessions: sessionmaker[Session], job_id: int,
               now: datetime, report: SweepReport) -> None:
    rows = settings.retention_sweep_rows
    keep = settings.retention_keep_metrics
    with sessions() as s:
        last = retention.last_index(s, job_id=job_id)
    for start in range(0, last + 1, rows):
        with sessions.begin() as s:
            if keep:
                report.items_emptied += retention.empty_items(s, job_id=job_id, start=start,
                                                              rows=rows)
            else:
                report.items_deleted += retention.delete_items(s, job_id=job_id, start=start,
                                                               rows=rows)
    with sessions.begin() as s:
        if keep:
            report.outputs += retention.delete_files(
                s, file_ids=retention.outputs_of(s, job_id=job_id))
            retention.mark_swept(s, job_id=job_id, now=now)
            report.jobs_emptied += 1
        else:
            retention.delete_job(s, job_id=job_id)
            report.jobs_deleted += 1


STRAY_AGE = 3600.0  # seconds: bytes younger than this may belong to an upload committing


def _reap_strays(settings: Settings, sessions: sessionmaker[Session]) -> int:
    """Delete the directory store's files that no row names and that are older than
    STRAY_AGE: the bytes of a row a sweep deleted just before it was stopped, or of an
    upload whose server died before its row committed. Each is logged; how many."""
    from specq.api.server.uploads import store_path

    try:
        names = [e for e in os.scandir(settings.files_dir)
                 if e.is_file() and e.name.startswith("file-") and e.name.endswith(".jsonl")
                 and time.time() - e.stat().st_mtime > STRAY_AGE]
    except FileNotFoundError:  # no directory store on this machine
        return 0
    reaped = 0
    for i in range(0, len(names), 500):
        batch = {e.name.removesuffix(".jsonl"): e for e in names[i:i + 500]}
        with sessions() as s:
            known = retention.known_files(s, openai_ids=list(batch))
        for openai_id in sorted(set(batch) - known):
            log.warning("retention sweep: %s: no file row names these bytes; deleted",
                        store_path(settings.files_dir, openai_id))
            _unlink(settings, openai_id)
            reaped += 1
    return reaped


def _unlink(settings: Settings, openai_id: str) -> None:
    from specq.api.server.uploads import store_path  # (the directory store's one layout)

    path = store_path(settings.files_dir, openai_id)
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("retention sweep: %s: its row is deleted, its bytes are not (%s)", path,
                    exc)


def count_swept(settings: Settings, report: SweepReport) -> None:
    """Add to the deployment's sweep counts on the broker, best effort."""
    try:
        client = connection.broker_client(settings)
        try:
            with client.pipeline(transaction=False) as pipe:
                for name, n in report.as_dict().items():
                    if n:
                        pipe.hincrby(swept_key(settings), name, n)
                pipe.execute()
        finally:
            client.close()
    except (redis.RedisError, OSError) as exc:
        log.info("sweep counts not recorded (%s)", exc)


def read_swept(client: redis.Redis, settings: Settings) -> dict[str, int]:
    raw = client.hgetall(swept_key(settings))
    got = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in raw.items()}
    return {name: got.get(name, 0) for name in WHAT}


def output_expiry(finished: datetime, seconds: int) -> datetime:
    """When a batch's output and error files expire: ``seconds`` (its create's
    output_expires_after) after its job finished (SQLite hands times back without their
    zone: UTC)."""
    return as_utc(finished) + timedelta(seconds=seconds)


# -- expires_after on uploads (OpenAI's shape) --------------------------------------------

EXPIRY_LIMITS = (3600, 30 * 86400)  # OpenAI's: an hour to thirty days


def upload_expiry(fields: dict[str, str], settings: Settings, created: datetime
                  ) -> datetime | None:
    """When an upload expires: its ``expires_after`` ({anchor: created_at, seconds: N},
    sent as the form fields expires_after[anchor] and expires_after[seconds]), else the
    operator's retention_files after ``created``, else never. ValueError naming the field
    that is wrong."""
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        if settings.retention_files is None:
            return None
        return created + timedelta(seconds=settings.retention_files)
    if anchor != "created_at":
        raise ValueError(f"expires_after.anchor: must be 'created_at', not {str(anchor)[:40]!r}")
    low, high = EXPIRY_LIMITS
    if seconds is None or not (seconds.strip().isascii() and seconds.strip().isdigit()) \
            or not low <= int(seconds) <= high:  # ASCII digits ("７２００" is a digit too)
        raise ValueError(f"expires_after.seconds: a whole number of seconds from {low} to "
                         f"{high}, not {str(seconds)[:40]!r}")
    return created + timedelta(seconds=int(seconds))
