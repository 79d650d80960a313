"""A job's state read with the database driver alone: `specq status JOB` in a fraction of a
second.

The client reads a job's state (api/client.py: Job.status) through the settings
(pydantic-settings), SQLAlchemy and the ORM models: 0.5-0.6 s of imports on this project's
2-core machine before a query of a few milliseconds. This module reads the same state with
the driver (psycopg, or the standard library's sqlite3) and one statement, which brings the
command to about 0.15 s. It answers only what it can answer exactly as the client would
(tests/db/test_glance.py holds the two equal on both databases) and gives None for
everything else, which then takes the client's path:

- the database must be the one the settings would pick without reading a file: the URL in
  SPECQ_DATABASE_URL (the environment outranks a .env file and every default), PostgreSQL
  on psycopg or a SQLite file; with no URL there, the embedded SQLite file in
  SPECQ_DATA_DIR or the user's data directory, and no .env file in the working directory
  (it could name another database);
- a job the workers should be running (queued or in progress, items pending) is answered
  here only while one of its chunks holds a live lease: a worker is then serving it and
  the client would add no note. With no live lease, whether any worker serves the pair is
  the broker's to say;
- a job with no chunks (stored by hand), a job not found, a chunk error kept on an
  unfinished job (its note names a setting), and any error at all (the server down, no
  schema, no file): the client's path, which also words the error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specq.db.timeouts import pg_timeouts

PSYCOPG = ("postgresql+psycopg://", "postgres://")  # what the settings take as psycopg's
DEFAULT_TIMEOUT = 10.0  # seconds: the client's sessions (db/session.py: session_factory)
RUNNABLE = ("queued", "in_progress")  # waiting for workers (api/client.py: RUNNABLE)
FINISHED = ("completed", "failed", "cancelled")  # db/models.py: JobStatus.finished

# The job, its chunks' item counts and faults (db/repository.py: status_counts,
# db/chunks.py: faults) and its chunks under a live lease (db/chunks.py: lease_until on the
# database's clock, NOW below as db/clock.py writes it per database), in one statement.
STATE = """
SELECT j.id, j.status, j.pair, j.total, j.created_at, j.finished_at, j.error,
       count(c.start), coalesce(sum(c.completed), 0), coalesce(sum(c.failed), 0),
       coalesce(sum(c.cancelled), 0), coalesce(sum(c.faults), 0),
       coalesce(sum(c.isolated), 0),
       count(c.start) FILTER (WHERE c.lease_owner IS NOT NULL AND c.lease_until > NOW),
       (SELECT f.first_fault FROM chunks f
         WHERE f.job_id = j.id AND f.first_fault IS NOT NULL
         ORDER BY f.first_fault_at, f.start LIMIT 1)
  FROM jobs j LEFT JOIN chunks c ON c.job_id = j.id
 WHERE j.id = JOB
 GROUP BY j.id
"""
POSTGRESQL = STATE.replace("NOW", "EXTRACT(EPOCH FROM clock_timestamp())").replace(
    "JOB", "%(job)s")
SQLITE = STATE.replace("NOW", "((julianday('now') - 2440587.5) * 86400.0)").replace(
    "JOB", ":job")


def database(environ: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """("postgresql", libpq URI) or ("sqlite", file path): the database the settings would
    pick, when it can be told without them (module docstring); else None."""
    url = environ.get("SPECQ_DATABASE_URL", "").strip()
    if not url:
        if Path(".env").exists():
            return None
        data_dir = environ.get("SPECQ_DATA_DIR", "").strip()
        if data_dir:
            home = Path(data_dir).expanduser().absolute()
        else:
            from platformdirs import user_data_dir

            home = Path(user_data_dir("specq", appauthor=False))
        return "sqlite", str(home / "specq.db")
    scheme = next((s for s in PSYCOPG if url.startswith(s)), None)
    if scheme is not None:
        return "postgresql", "postgresql://" + url.removeprefix(scheme)
    path = url.removeprefix("sqlite:///")
    if path != url and path and not path.startswith("file:") and not set("?#") & set(path):
        return "sqlite", str(Path(path).expanduser().absolute())
    return None


def job_state(job_id: int, environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The job's state as Job.status().as_dict() gives it, or None where this module cannot
    say it exactly so (see the module docstring)."""
    where = database(environ)
    if where is None:
        return None
    try:
        row = _read(*where, job_id)
    except Exception:  # noqa: BLE001 (whatever went wrong, the client's path says it)
        return None
    if row is None:
        return None
    (id_, status, pair, total, created_at, finished_at, error, chunks, completed, failed,
     cancelled, faults, isolated, leased, first_fault) = row
    pending = total - completed - failed - cancelled
    if (not chunks or (status in RUNNABLE and pending and not leased)
            or (error and status not in FINISHED)):
        return None
    return {"id": id_, "status": status, "pair": pair, "total": total,
            "completed": int(completed), "failed": int(failed), "cancelled": int(cancelled),
            "pending": int(pending), "created_at": _iso(created_at),
            "finished_at": _iso(finished_at), "error": error, "note": None,
            "engine_faults": int(faults), "first_fault": first_fault if faults else None,
            "items_isolated": int(isolated)}


def _read(kind: str, where: str, job_id: int) -> tuple[Any, ...] | None:
    """The statement's row for the job (None: no such job)."""
    if kind == "postgresql":
        import psycopg

        bounds: dict[str, Any] = dict(pg_timeouts(DEFAULT_TIMEOUT))
        with psycopg.connect(where, autocommit=True, **bounds) as conn:
            return conn.execute(POSTGRESQL, {"job": job_id}).fetchone()
    import sqlite3

    # read-only: a missing file is an error (the client's path says it), never a new one
    file = sqlite3.connect(f"{Path(where).as_uri()}?mode=ro", uri=True, timeout=30)
    try:
        row = file.execute(SQLITE, {"job": job_id}).fetchone()
    finally:
        file.close()
    return None if row is None else tuple(row)


def status_text(job_id: int) -> str | None:
    """What `specq status JOB` prints (the state as indented JSON), or None (above)."""
    state = job_state(job_id)
    return None if state is None else json.dumps(state, indent=2)


def _iso(t: datetime | str | None) -> str | None:
    """A time as the client prints it, in UTC with its offset (db/models.py: as_utc, not
    imported: it brings SQLAlchemy); SQLite keeps the text SQLAlchemy wrote, in UTC."""
    if isinstance(t, str):
        t = datetime.fromisoformat(t)
    if t is None:
        return None
    return (t.astimezone(timezone.utc) if t.tzinfo else t.replace(tzinfo=timezone.utc)).isoformat()
