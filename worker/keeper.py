"""The keeper of a running chunk: its lease and its outcomes, in a thread beside the engine.

While the engine generates, the keeper
- renews the chunk's lease every third of its length (a worker killed mid-chunk stops
  renewing, and the reconciler hands the chunk to another worker once the lease runs out);
- writes finished outcomes in small batches (every ``flush_every`` seconds or
  ``flush_items`` items), so a killed worker loses only the items still in flight;
- records engine failures (an item's attempts) in the same ordered stream;
- notices a lease taken over by another worker (after an outage longer than the lease)
  and a job being cancelled, so the engine can stop early.

Database outages are ridden out: outcomes stay in memory and the write is retried with
bounded back-off (worker/backoff.py) for as long as ``db_patience`` allows; nothing is
regenerated. Writes are idempotent (only pending items are written), so two workers
that both ran an item cannot both store it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from specq.configs.settings import Settings
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import JobStatus
from specq.db.outcomes import Outcome
from specq.worker.backoff import UNREACHABLE, Backoff, retry_db, short_error

log = logging.getLogger(__name__)


@dataclass
class _Failures:
    """An engine failure to record: these items' attempts go up by one."""

    indices: list[int]
    error: str


@dataclass
class KeeperReport:
    written: int = 0  # outcomes this run stored
    unwritten: int = 0  # already written by another run of the chunk
    failures: int = 0  # engine failures recorded (attempts)
    done: bool = False  # no pending item left in the chunk at the end
    job_status: str = ""


class ChunkKeeper:
    def __init__(self, sessions: sessionmaker[Session], settings: Settings, job_id: int,
                 start: int, end: int, owner: str) -> None:
        self.sessions, self.settings, self.owner = sessions, settings, owner
        self.job_id, self.start_index, self.end = job_id, start, end
        self.report = KeeperReport()
        self._queue: list[Outcome | _Failures] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.lost = threading.Event()  # another worker holds the lease now
        self.cancelling = threading.Event()  # the job is being cancelled
        self.backoff = Backoff.from_settings(self.settings)
        self._where = f"job {self.job_id}: chunk [{start}, {end})"

    # -- the engine's side ----------------------------------------------------------

    def start(self) -> ChunkKeeper:
        self._thread = threading.Thread(target=self._run, name=f"keeper-{self.job_id}-"
                                        f"{self.start_index}", daemon=True)
        self._thread.start()
        return self

    def put(self, outcome: Outcome) -> None:
        """A finished item's outcome, to be written in the next batch."""
        with self._cond:
            self._queue.append(outcome)
            if len(self._queue) >= self.settings.flush_items:
                self._cond.notify()

    def failed(self, indices: list[int], error: str) -> None:
        """An engine failure struck these items: their attempts go up (and their error)."""
        if indices:
            with self._cond:
                self._queue.append(_Failures(list(indices), error))
                self._cond.notify()

    def should_stop(self) -> bool:
        return self.lost.is_set() or self.cancelling.is_set()

    def close(self) -> KeeperReport:
        """Write what is left (retrying through an outage), give the lease back, settle
        the job if this chunk is done. Raises if the database stays away past patience."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        retry_db(self._drain, backoff=self.backoff, what=self._where)
        retry_db(self._release, backoff=self.backoff, what=self._where)
        return self.report

    # -- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        beat = self.settings.lease_seconds / 3
        next_beat = time.monotonic() + beat
        next_flush = time.monotonic() + self.settings.flush_every
        failures = 0  # consecutive failed database calls: they space the next ones
        while True:
            with self._cond:
                now = time.monotonic()
                wait = min(next_beat, next_flush if self._queue else next_beat) - now
                if not self._stop and wait > 0 and len(self._queue) < self.settings.flush_items:
                    self._cond.wait(wait)
                if self._stop:
                    return
            now = time.monotonic()
            try:
                if now >= next_beat:
                    self._heartbeat()
                    next_beat = now + beat
                if self._queue and (now >= next_flush
                                    or len(self._queue) >= self.settings.flush_items):
                    self._drain()
                    next_flush = time.monotonic() + self.settings.flush_every
                failures = 0
            except UNREACHABLE as exc:
                pause = self.backoff.pause(failures)
                failures += 1
                log.warning("%s: database unreachable (%s); %d outcomes kept, next try in "
                            "%.1f s", self._where, short_error(exc), len(self._queue), pause)
                next_flush = next_beat = time.monotonic() + pause
            except Exception:  # a bug must not kill the heartbeat silently
                log.exception("%s: keeper error", self._where)
                time.sleep(1.0)

    def _heartbeat(self) -> None:
        with self.sessions.begin() as s:
            held = chunks.renew(s, job_id=self.job_id, start=self.start_index, owner=self.owner,
                                ttl=self.settings.lease_seconds)
            job = repo.get_job(s, job_id=self.job_id)
        if not held and not self.lost.is_set():
            log.warning("%s: lease lost (another worker took the chunk over); stopping",
                        self._where)
            self.lost.set()
        if job is None or JobStatus(job.status) in (JobStatus.cancelling, JobStatus.cancelled):
            self.cancelling.set()

    def _drain(self) -> None:
        """Write everything queued, in order; on an outage what is unwritten stays queued."""
        with self._cond:
            batch, self._queue = self._queue, []
        try:
            while batch:
                op = batch[0]
                if isinstance(op, _Failures):
                    with self.sessions.begin() as s:
                        repo.record_failures(s, job_id=self.job_id, indices=op.indices,
                                             error=op.error)
                    self.report.failures += 1
                    batch.pop(0)
                    continue
                n = next((i for i, o in enumerate(batch) if isinstance(o, _Failures)),
                         len(batch))
                self._write(batch[:n])
                del batch[:n]
        finally:
            if batch:  # put back, ahead of anything queued meanwhile
                with self._cond:
                    self._queue = batch + self._queue

    def _write(self, outcomes: list[Outcome]) -> None:
        try:
            with self.sessions.begin() as s:
                n = repo.write_outcomes(s, job_id=self.job_id, outcomes=outcomes)
        except UNREACHABLE:
            raise
        except SQLAlchemyError:  # an outcome the database refuses: find it, store why
            log.exception("%s: outcomes refused; writing them one by one", self._where)
            n = sum(self._write_one(o) for o in outcomes)
        self.report.written += n
        self.report.unwritten += len(outcomes) - n

    def _write_one(self, outcome: Outcome) -> int:
        try:
            with self.sessions.begin() as s:
                return repo.write_outcomes(s, job_id=self.job_id, outcomes=[outcome])
        except UNREACHABLE:
            raise
        except SQLAlchemyError as exc:
            orig = getattr(exc, "orig", None) or exc
            failed = Outcome.failure(outcome.index, f"could not store the outcome: "
                                     f"{type(orig).__name__}: {orig}", worker=outcome.worker,
                                     started_at=outcome.started_at,
                                     finished_at=outcome.finished_at)
            with self.sessions.begin() as s:
                return repo.write_outcomes(s, job_id=self.job_id, outcomes=[failed])

    def _release(self) -> None:
        with self.sessions.begin() as s:  # the chunk's outcomes are committed by now
            done = chunks.release(s, job_id=self.job_id, start=self.start_index, end=self.end,
                                  owner=self.owner)
            self.report.done = done
            if done:  # this chunk's last items may have been the job's last
                self.report.job_status = repo.settle_job(s, job_id=self.job_id).value
            else:
                self.report.job_status = repo.get_job(s, job_id=self.job_id).status
