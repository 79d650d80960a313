"""A job's state read with the PostgreSQL driver alone: `specq status JOB` in a fraction of
a second.

The client reads a job's state (api/client.py: Job.status) through the settings
(pydantic-settings), SQLAlchemy and the ORM models: 0.5-0.6 s of imports on this project's
2-core machine before a query of a few milliseconds. This module reads the same state with
psycopg and one statement, which brings the command to about 0.15 s. It answers only what it
can answer exactly as the client would (tests/test_glance.py holds the two equal) and gives
None for everything else, which then takes the client's path:

- the database URL must come from SPECQ_DATABASE_URL in the environment (which outranks a
  .env file and every default) and be PostgreSQL on psycopg; the SQLite default, a URL from
  a .env file and any other driver go the client's way;
- a job the workers should be running (queued or in progress, items pending) is answered
  here only while one of its chunks holds a live lease: a worker is then serving it and
  the client would add no note. With no live lease, whether any worker serves the pair is
  the broker's to say;
- a job with no chunks (stored by hand), a job not found, a chunk error kept on an
  unfinished job (its note names a setting), and any error at all (the server down, no
  schema): the client's path, which also words the error.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

from specq.db.timeouts import pg_timeouts

SCHEMES = ("postgresql+psycopg://", "postgres://")  # what the settings take as psycopg's
DEFAULT_TIMEOUT = 10.0  # seconds: the client's sessions (db/session.py: session_factory)
RUNNABLE = ("queued", "in_progress")  # waiting for workers (api/client.py: RUNNABLE)
FINISHED = ("completed", "failed", "cancelled")  # db/models.py: JobStatus.finished

# The job, its chunks' item counts and faults (db/repository.py: status_counts,
# db/chunks.py: faults) and its chunks under a live lease (db/chunks.py: lease_until on the
# database's clock, db/clock.py), in one statement.
STATE = """
SELECT j.id, j.status, j.pair, j.total, j.created_at, j.finished_at, j.error,
       count(c.start), coalesce(sum(c.completed), 0), coalesce(sum(c.failed), 0),
       coalesce(sum(c.cancelled), 0), coalesce(sum(c.faults), 0),
       coalesce(sum(c.isolated), 0),
       count(c.start) FILTER (WHERE c.lease_owner IS NOT NULL
                              AND c.lease_until > EXTRACT(EPOCH FROM clock_timestamp())),
       (SELECT f.first_fault FROM chunks f
         WHERE f.job_id = j.id AND f.first_fault IS NOT NULL
         ORDER BY f.first_fault_at, f.start LIMIT 1)
  FROM jobs j LEFT JOIN chunks c ON c.job_id = j.id
 WHERE j.id = %(job)s
 GROUP BY j.id
"""


def conninfo(environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """The libpq URI of SPECQ_DATABASE_URL when it is PostgreSQL on psycopg, else None."""
    url = environ.get("SPECQ_DATABASE_URL", "").strip()
    scheme = next((s for s in SCHEMES if url.startswith(s)), None)
    return None if scheme is None else "postgresql://" + url.removeprefix(scheme)


def job_state(job_id: int) -> dict[str, Any] | None:
    """The job's state as Job.status().as_dict() gives it, or None where this module cannot
    say it exactly so (see the module docstring)."""
    uri = conninfo()
    if uri is None:
        return None
    try:
        import psycopg

        bounds: dict[str, Any] = dict(pg_timeouts(DEFAULT_TIMEOUT))
        with psycopg.connect(uri, autocommit=True, **bounds) as conn:
            row = conn.execute(STATE, {"job": job_id}).fetchone()
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


def status_text(job_id: int) -> str | None:
    """What `specq status JOB` prints (the state as indented JSON), or None (above)."""
    state = job_state(job_id)
    return None if state is None else json.dumps(state, indent=2)


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None
