"""Scheduled synthesis: Celery beat fires the schedules of SPECQ_SCHEDULES_FILE.

`specq beat` runs `celery -A specq.api.beat worker -B` on the queue PREFIX.synth: the embedded
beat sends FIRE_TASK for each schedule at its slots and COLLECT_TASK every COLLECT_EVERY
seconds, and the same process (no GPU, no model) runs them:

- fire(name): under a Redis lock keyed by the schedule's name, skip the slot if a run of
  that schedule is still unfinished in the database, otherwise submit the spec as an
  ordinary job that records its spec and schedule. The lock makes check-and-submit atomic
  across concurrent firings; the database says whether the last run is still going. A
  run still going is reconciled first (a lost message cannot stall it), and once older
  than the schedule's ``stuck_after`` it is stuck: the firing logs an error saying so and
  (``on_stuck: cancel``, the default) cancels it and starts a new run.
- collect(): write the data set of every finished synthesis run that has none yet.
- reconcile (RECONCILE_TASK, every SPECQ_RECONCILE_EVERY seconds): broker/reconciler.py.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import Celery

from specq.api.client import Client
from specq.api.synthesis import load_spec, submit, write_output
from specq.broker.app import make_app
from specq.broker.names import COLLECT_TASK, FIRE_TASK, RECONCILE_TASK, synth_queue
from specq.broker.reconciler import reconcile, reconcile_if_due
from specq.configs.schedules import Schedule, load_schedules
from specq.configs.settings import Settings, get_settings
from specq.db import repository as repo
from specq.db.models import as_utc, utcnow

log = logging.getLogger(__name__)

COLLECT_EVERY = 30.0  # seconds between two looks for finished runs to write


def lock_key(name: str, settings: Settings) -> str:
    return f"{settings.queue_prefix}:schedule-lock:{name}"


def fire(name: str, settings: Settings | None = None) -> int | None:
    """Start a run of schedule ``name`` unless one is still going; the new job's id or None."""
    settings = settings or get_settings()
    schedule = load_schedules(settings.schedules_file)[name]
    r = redis.Redis.from_url(settings.broker_url)
    lock = r.lock(lock_key(name, settings), timeout=settings.schedule_lock_ttl)
    if not lock.acquire(blocking=False):
        log.info("schedule %s: another firing holds the lock; slot skipped", name)
        return None
    try:
        client = Client(settings)
        with client.sessions() as s:
            running = repo.unfinished_runs(s, schedule=name)
        if running and not _stuck(client, schedule, running, settings):
            return None
        job = submit(client, load_spec(schedule.spec, data_dir=settings.data_dir),
                     schedule=name)
        return job.id
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:  # expired while submitting (TTL too short)
            log.warning("schedule %s: lock expired before the run was stored; raise "
                        "SPECQ_SCHEDULE_LOCK_TTL", name)
        r.close()


def _stuck(client: Client, schedule: Schedule, running: list[int], settings: Settings) -> bool:
    """Whether every unfinished run of ``schedule`` is stuck and was cancelled (a new run
    may start). Lost chunks of each run are re-sent first."""
    for job_id in running:
        try:
            reconcile(settings, job_id=job_id)
        except Exception as exc:  # noqa: BLE001 (the broker away: say so, go on)
            log.warning("schedule %s: run %d not reconciled: %s", schedule.name, job_id, exc)
        state = client.job(job_id).status(check_workers=False)
        assert state.created_at is not None  # a stored job's
        age = (utcnow() - as_utc(state.created_at)).total_seconds()
        if age < schedule.stuck_after:
            log.info("schedule %s: run %d still going (%d/%d done); slot skipped",
                     schedule.name, job_id, state.ended, state.total)
            return False
        state = client.job(job_id).status()  # with the note saying whether a worker serves it
        said = (f"schedule {schedule.name}: run {job_id} is stuck: {state.status} for "
                f"{age / 3600:.1f} h with {state.ended}/{state.total} ended"
                f"{'; ' + state.note if state.note else ''}")
        if schedule.on_stuck == "skip":
            log.error("%s; slot skipped (on_stuck: skip)", said)
            return False
        log.error("%s; cancelled, a new run starts", said)
        client.job(job_id).cancel()
    return True


def collect(settings: Settings | None = None) -> list[str]:
    """Write the data sets of finished synthesis runs that have none yet; their paths."""
    settings = settings or get_settings()
    client = Client(settings)
    with client.sessions() as s:
        ids = repo.unwritten_runs(s)
    written = []
    for job_id in ids:
        try:
            written.append(str(write_output(client, job_id)))
        except Exception:  # one run's failure (e.g. its seed file changed) stops no other
            log.exception("job %d: data set not written; will try again", job_id)
    return written


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """The beat_schedule of the schedules file, plus the collector."""
    queue = synth_queue(settings)
    entries: dict[str, dict[str, Any]] = {
        f"schedule:{name}": {"task": FIRE_TASK, "schedule": s.celery_schedule(),
                             "args": [name], "options": {"queue": queue}}
        for name, s in load_schedules(settings.schedules_file).items()
    }
    entries["collect"] = {"task": COLLECT_TASK, "schedule": COLLECT_EVERY,
                          "options": {"queue": queue}}
    if settings.reconcile_every > 0:
        entries["reconcile"] = {"task": RECONCILE_TASK, "schedule": settings.reconcile_every,
                                "options": {"queue": queue, "expires": settings.reconcile_every}}
    return entries


def make_beat_app(settings: Settings) -> Celery:
    app = make_app(settings, tasks=False)
    app.conf.update(beat_schedule=beat_schedule(settings), timezone="UTC")
    app.task(name=FIRE_TASK)(fire_task)
    app.task(name=COLLECT_TASK)(collect_task)
    app.task(name=RECONCILE_TASK)(reconcile_task)
    return app


def fire_task(name: str) -> int | None:
    return fire(name)


def collect_task() -> list[str]:
    return collect()


def reconcile_task() -> dict[str, Any] | None:
    report = reconcile_if_due(get_settings())
    return report.as_dict() if report else None


app = make_beat_app(get_settings())
