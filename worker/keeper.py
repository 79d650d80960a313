"""The keeper of a chunk's run (worker/run.py, whose glossary names the terms used here):
its lease and its writes, in threads beside the engine.

Every write is made in a transaction that first finds the run still owning the lease
(db/chunks.py: holds), and a write found superseded is refused, counted
(KeeperReport.refused), and stops the run. While the engine generates, the keeper
- renews the lease every third of its length (a worker killed mid-chunk stops renewing,
  and the reconciler hands the chunk to another worker once the lease runs out);
- gives the run up before anyone may take it over: once no renewal has succeeded for two
  thirds of the lease (a database that stopped answering, a stalled connection), the run
  stops itself (Stopped), says so on the broker (broker/presence.py: record_give_up), and
  its items in flight are released, not charged (the takeover finds the give-up);
- writes finished outcomes in small batches (every ``flush_every`` seconds or
  ``flush_items`` items), so a killed worker loses only the items still in flight;
- records faults (an item's attempts, the chunk's fault count) in the same ordered stream;
  a fault record the database refuses (a bad value, not an outage) is logged and dropped,
  never holding the outcomes behind it;
- marks the items of each batch the engine starts (``launch``), at once, so that the run
  after a worker's death knows which items were in flight: one short statement on the
  engine's thread, which also clears the marks of the items whose outcomes wait in the
  queue (the outcomes themselves are written by the keeper's thread, off the engine's path);
- notices a lease taken over by another worker and a job being cancelled, so the engine
  can stop early.

Database outages are ridden out: outcomes stay in memory and the write is retried with
bounded back-off (worker/backoff.py) for as long as ``db_patience`` allows; the run stops
generating once it gives its lease up, and what it finished is written when the database
answers again, unless another run has taken the chunk by then (then it is refused, and
the other run generates those items again). Writes are idempotent (only pending items are
written), so two workers that both ran an item cannot both store it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from specq.configs.settings import Settings
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import JobStatus
from specq.db.outcomes import Outcome, storable
from specq.db.session import autocommit, dialect_name
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


class Stopped(Exception):
    """The keeper asked the engine to stop: the lease was lost or given up, a write was
    refused (another run holds the chunk), or the job is being cancelled."""


@dataclass
class KeeperReport:
    """What the keeper wrote; changed only under the keeper's write lock (two threads
    write: the keeper's and, for launch marks, the engine's)."""

    written: int = 0  # outcomes this run stored
    unwritten: int = 0  # already written by another run of the chunk, or refused
    failures: int = 0  # faults recorded
    refused: int = 0  # writes refused: another run held the lease (outcomes, faults, marks)
    dropped: int = 0  # fault records the database refused (logged, not retried)
    done: bool = False  # no pending item left in the chunk at the end
    job_status: str = ""


class ChunkKeeper:
    def __init__(self, sessions: sessionmaker[Session], settings: Settings, job_id: int,
                 start: int, end: int, owner: str, price: float | None = None,
                 leased_at: float | None = None,
                 on_give_up: Callable[[str], None] | None = None) -> None:
        """``leased_at``: the monotonic time the run's claim was sent (the lease runs at
        least ``lease_seconds`` from then); ``on_give_up(owner)``: says on the broker that
        the run gave its lease up alive (worker/tasks.py)."""
        self.sessions, self.settings, self.owner = sessions, settings, owner
        self._postgres = dialect_name(sessions) == "postgresql"
        self._launcher: Connection | None = None  # launches' autocommit connection (_mark)
        self.price = price  # per device-hour: the run's held time is charged at it
        self.job_id, self.start_index, self.end = job_id, start, end
        self.report = KeeperReport()
        self._queue: list[Outcome | _Fault] = []
        self._queued: set[int] = set()  # the items of the outcomes in _queue
        self._cond = threading.Condition()
        self._marking = threading.Lock()  # held by a launch: the queue is not taken meanwhile
        self._writing = threading.RLock()  # one writer at a time, in queue order
        self._counting = threading.Lock()  # the report's refused count, from either thread
        self._stop = False
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._renewed = time.monotonic() if leased_at is None else leased_at
        self._on_give_up = on_give_up
        self.lost = threading.Event()  # another worker holds the lease now
        self.gave_up = threading.Event()  # renewals failed too long: the run gave up
        self.cancelling = threading.Event()  # the job is being cancelled
        self.backoff = Backoff.from_settings(self.settings)
        self._where = f"job {self.job_id}: chunk [{start}, {end})"

    # -- the engine's side ----------------------------------------------------------

    def start(self) -> ChunkKeeper:
        name = f"{self.job_id}-{self.start_index}"
        self._thread = threading.Thread(target=self._run, name=f"keeper-{name}", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name=f"lease-{name}", daemon=True)
        self._thread.start()
        self._watcher.start()
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
        launch = None if generation is None else repo.launch_mark(self.owner, generation)
        self._fault(_Fault("error", list(indices), error, launch))

    def out_of_memory(self, error: str) -> None:
        """Out of memory, retried at a smaller batch: the chunk counts a fault."""
        self._fault(_Fault("oom", [], error))

    def crashed(self, indices: list[int], why: str) -> None:
        """The device is gone with these items in flight: each counts a crash."""
        self._fault(_Fault("crash", list(indices), why))

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
        (the queue is not taken while it runs), made only if the run owns a live lease
        (on PostgreSQL the lease's test and the marks are one statement). Written from the
        caller's thread, now; with the database away the mark is skipped (the chunk's run
        limit still bounds a poison batch). Raises Stopped when the run should stop, or the
        mark was refused."""
        if self.should_stop() or self._overdue():
            raise Stopped
        try:
            with self._marking:
                with self._cond:
                    finished = sorted(self._queued)
                if not self._mark(indices, repo.launch_mark(self.owner, generation), finished):
                    self._refuse(len(indices))
        except UNREACHABLE as exc:
            log.warning("%s: items %s not marked in flight (%s)", self._where, indices,
                        short_error(exc))
        if self.should_stop():
            raise Stopped

    def _mark(self, indices: list[int], launch: str, finished: list[int]) -> bool:
        """The launch's one write (repo.mark_launch_held); whether the run held the lease.
        On PostgreSQL one statement on the run's own connection in autocommit: one round
        trip on the engine's thread, no BEGIN, COMMIT or pool check-out. A connection that
        fails is dropped, and the next launch takes a fresh one."""
        def mark(on: Session | Connection) -> bool:
            return repo.mark_launch_held(on, job_id=self.job_id, start=self.start_index,
                                         owner=self.owner, indices=indices, launch=launch,
                                         finished=finished)

        if not self._postgres:
            with self.sessions.begin() as s:
                return mark(s)
        if self._launcher is None:
            self._launcher = autocommit(self.sessions)
        try:
            return mark(self._launcher)
        except BaseException:
            self._drop_launcher()
            raise

    def _drop_launcher(self) -> None:
        launcher, self._launcher = self._launcher, None
        if launcher is not None:
            try:
                launcher.close()
            except Exception as exc:  # noqa: BLE001 (a broken connection: nothing to keep)
                log.debug("%s: the launch connection did not close cleanly (%s)", self._where,
                          short_error(exc))

    def should_stop(self) -> bool:
        return self.lost.is_set() or self.gave_up.is_set() or self.cancelling.is_set()

    def _overdue(self) -> bool:
        """No renewal for two thirds of the lease: the run gives up now, if the watcher has
        not yet (a launch mark is never written past this point: a takeover may find it
        before the give-up)."""
        silent = time.monotonic() - self._renewed
        if silent < self.settings.lease_seconds * 2 / 3:
            return False
        self._give_up(silent)
        return True

    def close(self) -> KeeperReport:
        """Write what is left (retrying through an outage), give the lease back and release
        the run's items in flight, settle the job if this chunk is done. Raises if the
        database stays away past patience."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._drop_launcher()  # the engine's thread, which launches, is the one closing
        try:  # the watcher watches to the end: a close stuck in a stall gives up on time
            if self._thread is not None:
                self._thread.join()
            retry_db(self._drain, backoff=self.backoff, what=self._where)
            retry_db(self._release, backoff=self.backoff, what=self._where)
        finally:
            self._closed.set()
            if self._watcher is not None:
                self._watcher.join()
        return self.report

    # -- the threads ------------------------------------------------------------------

    def _watch(self) -> None:
        """Give the run up once no renewal has succeeded for two thirds of the lease: the
        lease runs out a third of it later at the soonest, and only then may another
        worker take the chunk. Touches no database (the keeper's thread may be stuck in
        one call)."""
        limit = self.settings.lease_seconds * 2 / 3
        while not self._closed.wait(max(0.05, self._renewed + limit - time.monotonic())):
            if time.monotonic() - self._renewed >= limit:
                self._give_up(time.monotonic() - self._renewed)
                return

    def _give_up(self, silent: float) -> None:
        with self._cond:  # once, from the watcher or the engine's thread
            if self.gave_up.is_set():
                return
            self.gave_up.set()
        log.warning("%s: no lease renewal for %.1f s (two thirds of the %.0f s lease); the "
                    "run gives the chunk up, its items in flight released", self._where,
                    silent, self.settings.lease_seconds)
        metrics.active().leases_given_up.inc()
        if self._on_give_up is not None:
            try:
                self._on_give_up(self.owner)
            except Exception as exc:  # noqa: BLE001 (the broker's errors vary by transport)
                log.warning("%s: the give-up was not recorded on the broker (%s); a takeover "
                            "charges the items in flight a crash", self._where, exc)

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
                    if not self.gave_up.is_set():  # a run given up renews nothing
                        self._heartbeat()
                    next_beat = now + beat
                if self._queue and (now >= next_flush
                                    or len(self._queue) >= self.settings.flush_items):
                    self._drain()
                    next_flush = time.monotonic() + self.settings.flush_every
                failures = 0
            except UNREACHABLE as exc:
                pause = min(self.backoff.pause(failures), beat)  # a renewal a beat at most
                failures += 1
                log.warning("%s: database unreachable (%s); %d outcomes kept, next try in "
                            "%.1f s", self._where, short_error(exc), len(self._queue), pause)
                next_flush = next_beat = time.monotonic() + pause
            except Exception:  # a bug must not kill the heartbeat silently
                log.exception("%s: keeper error", self._where)
                time.sleep(1.0)

    def _heartbeat(self) -> None:
        sent = time.monotonic()  # the lease runs lease_seconds from the renewal's commit
        try:
            with self.sessions.begin() as s:
                held = chunks.renew(s, job_id=self.job_id, start=self.start_index,
                                    owner=self.owner, ttl=self.settings.lease_seconds,
                                    price=self.price)
                job = repo.get_job(s, job_id=self.job_id)
        except UNREACHABLE:
            metrics.active().lease_renewals_failed.inc()
            raise
        if held and not self.gave_up.is_set():
            self._renewed = sent
        if not held:
            metrics.active().lease_renewals_failed.inc()
        if not held and not self.lost.is_set():
            log.warning("%s: lease lost (another worker took the chunk over); stopping",
                        self._where)
            self.lost.set()
        if job is None or JobStatus(job.status) in (JobStatus.cancelling, JobStatus.cancelled):
            self.cancelling.set()

    # -- the writes: each in a transaction that finds the run owning the lease ----------

    def _owned(self, s: Session, writes: int = 1) -> bool:
        """Whether this run still holds the chunk's lease (in the transaction ``s``, which
        then writes); if not, ``writes`` are refused and counted, and the run stops."""
        if chunks.holds(s, job_id=self.job_id, start=self.start_index, owner=self.owner):
            return True
        self._refuse(writes)
        return False

    def _refuse(self, writes: int) -> None:
        """``writes`` refused: this run holds the lease no more, so it stops."""
        with self._counting:  # a launch refuses from the engine's thread, writes from ours
            self.report.refused += writes
        metrics.active().writes_refused.inc(writes)
        if not self.lost.is_set():
            log.warning("%s: this run holds the chunk's lease no more; its writes are "
                        "refused and it stops", self._where)
            self.lost.set()

    def _drain(self) -> None:
        """Write everything queued, in order; on an outage what is unwritten stays queued."""
        with self._writing:
            with self._marking, self._cond:  # no launch is clearing these items' marks now
                batch, self._queue = self._queue, []
                self._queued.clear()
            try:
                while batch:
                    op = batch[0]
                    if isinstance(op, _Fault):
                        self._record(op)
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

    def _record(self, fault: _Fault) -> None:
        """Record a fault; one the database refuses (anything but an outage, which
        raises) is logged and dropped: the outcomes behind it are written."""
        job_id, start = self.job_id, self.start_index
        try:
            with self.sessions.begin() as s:
                if not self._owned(s):
                    return
                if fault.kind == "error":
                    repo.record_failures(s, job_id=job_id, start=start, indices=fault.indices,
                                         error=fault.error, launch=fault.launch)
                elif fault.kind == "crash":
                    repo.record_crash(s, job_id=job_id, start=start, indices=fault.indices,
                                      why=fault.error)
                else:
                    chunks.add_fault(s, job_id=job_id, start=start, error=fault.error)
            self.report.failures += 1
        except UNREACHABLE:
            raise
        except SQLAlchemyError as exc:
            self.report.dropped += 1
            log.error("%s: the %s fault record on items %s was refused by the database and "
                      "is dropped (%s)", self._where, fault.kind, fault.indices,
                      short_error(exc))

    def _write(self, outcomes: list[Outcome]) -> None:
        try:
            with self.sessions.begin() as s:
                if not self._owned(s, len(outcomes)):
                    self.report.unwritten += len(outcomes)
                    return
                written = repo.store_outcomes(
                    s, job_id=self.job_id, outcomes=outcomes,
                    charge=(self.start_index, self.owner, self.price))  # the lease is ours
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
            return self._store([outcome])
        except UNREACHABLE:
            raise
        except SQLAlchemyError as exc:
            orig = getattr(exc, "orig", None) or exc
            failed = Outcome.failure(outcome.index, storable(
                f"could not store the outcome: {type(orig).__name__}: {orig}"),
                worker=outcome.worker, started_at=outcome.started_at,
                finished_at=outcome.finished_at)
            return self._store([failed])

    def _store(self, outcomes: list[Outcome]) -> int:
        with self.sessions.begin() as s:
            if not self._owned(s, len(outcomes)):
                return 0
            written = repo.store_outcomes(s, job_id=self.job_id, outcomes=outcomes)
        metrics.active().written(written)
        return len(written)

    def _release(self) -> None:
        with self.sessions.begin() as s:  # the chunk's outcomes are committed by now
            if chunks.holds(s, job_id=self.job_id, start=self.start_index, owner=self.owner):
                repo.clear_launches(s, job_id=self.job_id, start=self.start_index,
                                    end=self.end, owner=self.owner)
            done = chunks.release(s, job_id=self.job_id, start=self.start_index, end=self.end,
                                  owner=self.owner, price=self.price)
            self.report.done = done
            if done:  # this chunk's last items may have been the job's last
                self.report.job_status = repo.settle_job(s, job_id=self.job_id).value
            else:
                self.report.job_status = repo.require_job(s, job_id=self.job_id).status
