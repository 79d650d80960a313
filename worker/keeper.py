"""The keeper of a running chunk: its lease and its outcomes, in a thread beside the engine.

While the engine generates, the keeper
- renews the chunk's lease every third of its length (a worker killed mid-chunk stops
  renewing, and the reconciler hands the chunk to another worker once the lease runs out);
- writes finished outcomes in small batches (every ``flush_every`` seconds or
  ``flush_items`` items), so a killed worker loses only the items still in flight;
- records faults (an item's attempts, the chunk's fault count) in the same ordered stream;
- marks the items of each batch the engine starts (``launch``), at once, so that the run
  after a worker's death knows which items were in flight: one short statement on the
  engine's thread, which also clears the marks of the items whose outcomes wait in the
  queue (the outcomes themselves are written here, off the engine's path);
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
from typing import cast

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from specq.configs.settings import Settings
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import JobStatus
from specq.db.outcomes import Outcome
from specq.worker import metrics
from specq.worker.backoff import UNREACHABLE, Backoff, retry_db, short_error

log = logging.getLogger(__name__)


@dataclass
class _Fault:
    """A fault to record on the chunk and its items (db/repository.py):

    - ``error``: an engine exception struck the items of ``launch``: an attempt each;
    - ``oom``: out of memory, retried at a smaller batch: no item is charged;
    - ``crash``: the device is gone with the items in flight: a crash each (an attempt
      too if alone), as if the worker had died.
    """

    kind: str
    indices: list[int]
    error: str
    launch: str | None = None


@dataclass
class KeeperReport:
    written: int = 0  # outcomes this run stored
    unwritten: int = 0  # already written by another run of the chunk
    failures: int = 0  # faults recorded
    done: bool = False  # no pending item left in the chunk at the end
    job_status: str = ""


class ChunkKeeper:
    def __init__(self, sessions: sessionmaker[Session], settings: Settings, job_id: int,
                 start: int, end: int, owner: str, price: float | None = None) -> None:
        self.sessions, self.settings, self.owner = sessions, settings, owner
        self.price = price  # per device-hour: the run's held time is charged at it
        self.job_id, self.start_index, self.end = job_id, start, end
        self.report = KeeperReport()
        self._queue: list[Outcome | _Fault] = []
        self._queued: set[int] = set()  # the items of the outcomes in _queue
        self._cond = threading.Condition()
        self._marking = threading.Lock()  # held by a launch: the queue is not taken meanwhile
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
            self._queued.add(outcome.index)
            if len(self._queue) >= self.settings.flush_items:
                self._cond.notify()

    def failed(self, indices: list[int], error: str, generation: int | None = None) -> None:
        """An engine exception struck these items in the run's engine ``generation``: their
        attempts go up (and their error), and the chunk counts a fault."""
        launch = None if generation is None else self._launch(generation)
        self._fault(_Fault("error", list(indices), error, launch))

    def out_of_memory(self, error: str) -> None:
        """Out of memory, retried at a smaller batch: the chunk counts a fault."""
        self._fault(_Fault("oom", [], error))

    def crashed(self, indices: list[int], why: str) -> None:
        """The device is gone with these items in flight: each counts a crash."""
        self._fault(_Fault("crash", list(indices), why))

    def _launch(self, generation: int) -> str:
        """The mark of one engine generation of this run: unique to it."""
        return f"{self.owner[-200:]}#{generation}"  # the owner ends in a unique token

    def _fault(self, fault: _Fault) -> None:
        with self._cond:
            self._queue.append(fault)
            self._cond.notify()

    def launch(self, indices: list[int], generation: int) -> None:
        """These items join a batch of the run's engine ``generation``: mark them, committed
        before the batch runs, so that the next run of the chunk knows them if this worker
        dies (worker/attempts.py). An item that finished carries no mark into the batch that
        follows (else a worker dying in a later batch would blame it too): the same
        statement clears the marks of the items whose outcomes wait in the queue, and those
        being written now lose theirs as the write commits. The outcomes are left to the
        keeper's thread: this is one statement whatever is queued, on rows no write holds
        (the queue is not taken while it runs).
        Written from the caller's thread, now; with the database away the mark is skipped
        (the chunk's run limit still bounds a poison batch)."""
        try:
            with self._marking, self.sessions.begin() as s:
                with self._cond:
                    finished = sorted(self._queued)
                repo.mark_launch(s, job_id=self.job_id, indices=indices,
                                 launch=self._launch(generation), finished=finished)
        except UNREACHABLE as exc:
            log.warning("%s: items %s not marked in flight (%s)", self._where, indices,
                        short_error(exc))

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
        try:
            with self.sessions.begin() as s:
                held = chunks.renew(s, job_id=self.job_id, start=self.start_index,
                                    owner=self.owner, ttl=self.settings.lease_seconds,
                                    price=self.price)
                job = repo.get_job(s, job_id=self.job_id)
        except UNREACHABLE:
            metrics.active().lease_renewals_failed.inc()
            raise
        if not held:
            metrics.active().lease_renewals_failed.inc()
        if not held and not self.lost.is_set():
            log.warning("%s: lease lost (another worker took the chunk over); stopping",
                        self._where)
            self.lost.set()
        if job is None or JobStatus(job.status) in (JobStatus.cancelling, JobStatus.cancelled):
            self.cancelling.set()

    def _drain(self) -> None:
        """Write everything queued, in order; on an outage what is unwritten stays queued."""
        with self._marking, self._cond:  # no launch is clearing these items' marks now
            batch, self._queue = self._queue, []
            self._queued.clear()
        try:
            while batch:
                op = batch[0]
                if isinstance(op, _Fault):
                    with self.sessions.begin() as s:
                        self._record(s, op)
                    self.report.failures += 1
                    batch.pop(0)
                    continue
                n = next((i for i, o in enumerate(batch) if isinstance(o, _Fault)),
                         len(batch))
                self._write(cast(list[Outcome], batch[:n]))  # no _Fault before n
                del batch[:n]
        finally:
            if batch:  # put back, ahead of anything queued meanwhile
                with self._cond:
                    self._queue = batch + self._queue
                    self._queued.update(o.index for o in batch if isinstance(o, Outcome))

    def _record(self, s: Session, fault: _Fault) -> None:
        where = {"job_id": self.job_id, "start": self.start_index}
        if fault.kind == "error":
            repo.record_failures(s, **where, indices=fault.indices, error=fault.error,
                                 launch=fault.launch)
        elif fault.kind == "crash":
            repo.record_crash(s, **where, indices=fault.indices, why=fault.error)
        else:
            chunks.add_fault(s, **where, error=fault.error)

    def _write(self, outcomes: list[Outcome]) -> None:
        try:
            with self.sessions.begin() as s:
                written = repo.store_outcomes(s, job_id=self.job_id, outcomes=outcomes)
                chunks.charge(s, job_id=self.job_id, start=self.start_index, owner=self.owner,
                              price=self.price)
            metrics.active().written(written)
            n = len(written)
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
                written = repo.store_outcomes(s, job_id=self.job_id, outcomes=[outcome])
            metrics.active().written(written)
            return len(written)
        except UNREACHABLE:
            raise
        except SQLAlchemyError as exc:
            orig = getattr(exc, "orig", None) or exc
            failed = Outcome.failure(outcome.index, f"could not store the outcome: "
                                     f"{type(orig).__name__}: {orig}", worker=outcome.worker,
                                     started_at=outcome.started_at,
                                     finished_at=outcome.finished_at)
            with self.sessions.begin() as s:
                written = repo.store_outcomes(s, job_id=self.job_id, outcomes=[failed])
            metrics.active().written(written)
            return len(written)

    def _release(self) -> None:
        with self.sessions.begin() as s:  # the chunk's outcomes are committed by now
            done = chunks.release(s, job_id=self.job_id, start=self.start_index, end=self.end,
                                  owner=self.owner, price=self.price)
            self.report.done = done
            if done:  # this chunk's last items may have been the job's last
                self.report.job_status = repo.settle_job(s, job_id=self.job_id).value
            else:
                self.report.job_status = repo.require_job(s, job_id=self.job_id).status
