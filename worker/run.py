"""One run of a chunk: the only writer of the chunk's lease, marks, faults and outcomes.

The rule: while a run holds a chunk's lease it alone writes the chunk's launch marks,
fault records and outcomes, and each of those writes checks, in its own transaction, that
the run still holds the lease. A run that cannot renew gives the lease up before anyone
may take it over, so a live worker is never booked dead.

The job path's words, defined here once (other modules point here):

- **job**: what a producer submitted, its items stored before anything is sent.
- **item**: one prompt of a job; **pending** until its outcome is written.
- **chunk**: a range [start, end) of a job's items that travels as one message
  (db/chunks.py). Its **turn**: a job keeps a few chunk messages on the broker; each
  chunk's first run sends the job's next one (broker/dispatch.py).
- **run**: one worker's go at a chunk, from claiming its lease to giving it back. Its
  **owner** names it: HOSTNAME/PID/TOKEN, unique to the run.
- **lease**: the chunk row's (owner, until). Claimed when no live lease holds it,
  **renewed** every third of ``lease_seconds`` by the run's keeper (worker/keeper.py).
- **give up**: a run whose renewals have failed for two thirds of the lease stops itself
  (Stopped) and says so on the broker (broker/presence.py), before the lease can run out.
- **takeover**: a run claiming a lease that ran out; it **settles** what the run before it
  left in flight (below). A run whose lease was taken over is **superseded**: its writes
  are **refused** (counted in ChunkReport.refused) and it stops.
- **launch mark**: each batch the engine starts is marked on its items first
  (OWNER#GENERATION, **generation** counting the run's engine generations), committed
  before the batch runs. Items whose marks remain at a takeover were **in flight**.
- **released**: in-flight items of a run that stopped alive (gave up, superseded,
  cancelled): their marks are cleared and nothing is charged.
- **crash**: a takeover finds the marks of a run whose worker died; each item counts a
  crash. An **attempt** is counted when an engine exception strikes an item, and when a
  proven death struck it **alone** in its batch (then it was the cause beyond doubt).
  A death is proven when the run's process is no longer announced on the broker, or its
  lease ran out at least one lease ago; otherwise the takeover counts crashes only.
- **suspect**: an item a fault **struck** (attempts or crashes); suspects run alone after
  the rest of the chunk (worker/attempts.py), and one that then completes is **isolated**.
- **fault**: an engine exception, an out-of-memory halving or a death, counted on the chunk.
- **outcome**: what a finished item writes (db/outcomes.py): written once, only over a
  pending item, in small batches as items finish.
- **charge**: the device time a run held the chunk (and its price), added with each write.
- **abandoned**: a chunk taken ``max_chunk_runs`` times without finishing; its pending
  items fail. **patience**: how long a database outage is waited out (``db_patience``).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from specq.broker import connection, presence
from specq.broker.reconciler import fail_pending
from specq.configs.settings import Settings
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import JobStatus
from specq.db.outcomes import Outcome
from specq.worker import metrics
from specq.worker.attempts import ChunkItem, Tally
from specq.worker.backoff import Backoff, retry_db
from specq.worker.keeper import ChunkKeeper, Stopped

__all__ = ["BrokerLives", "ChunkReport", "ChunkRun", "Lives", "Stopped", "Work"]

log = logging.getLogger(__name__)


@dataclass
class ChunkReport:
    job_id: int
    start: int
    end: int
    written: int = 0  # outcomes written by this run
    skipped: int = 0  # items already written (a redelivered chunk) or not pending
    cancelled: int = 0
    failed: int = 0  # items this run failed for good (after max_attempts engine failures)
    faults: int = 0  # engine failures met (and retried or counted)
    resumed: bool = False  # an earlier run left items of it pending (a lost lease)
    crashed: int = 0  # items an earlier run's worker died with in flight (they run again)
    released: int = 0  # items an earlier run had in flight when it gave its lease up alive
    refused: int = 0  # this run's writes refused: another run held the lease
    job_status: str = ""
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


@dataclass
class Work:
    """What a run opened to generate: the job's parameters, the chunk's pending items, and
    the job's next chunk to send (the turn this run's message had)."""

    params: dict[str, Any]
    items: list[ChunkItem]
    turn: list[chunks.ChunkRef]


class Lives:
    """What a takeover knows of the runs before it (the embedded mode's: nothing; no other
    process takes its chunks over while it lives, so a run left behind died with it)."""

    def record_give_up(self, owner: str) -> None:
        return None

    def gave_up(self, owners: list[str]) -> set[str]:
        """Those of ``owners`` that gave their leases up alive."""
        return set()

    def announced(self, owners: list[str]) -> set[str]:
        """Those of ``owners`` whose process may still live (not proven dead)."""
        return set()


class BrokerLives(Lives):
    """A worker's: on the broker (broker/presence.py), which a worker whose database path
    stalls still reaches. A takeover that cannot read it counts crashes only, never
    attempts: it cannot prove a death."""

    def __init__(self, settings: Settings, pair: str) -> None:
        self.settings, self.pair = settings, pair

    def record_give_up(self, owner: str) -> None:
        client = connection.broker_client(self.settings)
        try:
            presence.record_give_up(client, self.settings, owner)
        finally:
            client.close()

    def gave_up(self, owners: list[str]) -> set[str]:
        return self._read(lambda c: presence.gave_up(c, self.settings, owners), set(), owners)

    def announced(self, owners: list[str]) -> set[str]:
        return self._read(lambda c: presence.alive(c, self.settings, self.pair, owners),
                          set(owners), owners)

    def _read(self, read: Any, otherwise: set[str], owners: list[str]) -> set[str]:
        try:
            client = connection.broker_client(self.settings)
            try:
                return set(read(client))
            finally:
                client.close()
        except Exception as exc:  # noqa: BLE001 (the broker's errors vary by transport)
            log.warning("the broker was not read for runs %s (%s); their items in flight are "
                        "charged a crash, no attempt", owners, exc)
            return otherwise


class ChunkRun:
    """One run of the chunk [start, end) of ``job_id`` on this worker.

    open() claims the lease and settles what an earlier run left; the engine then reports
    through launch, put, failed, out_of_memory and crashed (its keeper writes them while
    the run holds the lease); close() writes what is left and gives the lease back. The
    report says what the run did."""

    def __init__(self, *, sessions: sessionmaker[Session], settings: Settings, pair: str,
                 job_id: int, start: int, end: int, hostname: str,
                 price: float | None = None, lives: Lives | None = None) -> None:
        self.sessions, self.settings, self.pair = sessions, settings, pair
        self.job_id, self.start, self.end = job_id, start, end
        self.owner = f"{hostname}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self.price, self.lives = price, lives or Lives()
        self.report = ChunkReport(job_id, start, end)
        self.where = f"job {job_id}: chunk [{start}, {end})"
        self.backoff = Backoff.from_settings(settings)
        self.keeper: ChunkKeeper | None = None
        self._items = 0

    # -- open ---------------------------------------------------------------------------

    def open(self, *, send_next: bool = False) -> Work | None:
        """Claim the lease (an outage waited out) and read the pending items; start the
        keeper. None when there is nothing to generate (the report says why)."""
        leased_at = time.monotonic()

        def claim() -> Work | None:
            nonlocal leased_at
            leased_at = time.monotonic()  # the lease runs lease_seconds from its commit
            # a transaction an outage rolled back counts nothing: each try reports afresh
            self.report = ChunkReport(self.job_id, self.start, self.end)
            with self.sessions.begin() as s:
                return self._open_in(s, send_next)

        work = retry_db(claim, backoff=self.backoff, what=self.where)
        counts = metrics.active()
        counts.items_failed.inc(self.report.failed)  # abandoned: failed before the engine
        counts.chunks_resumed.inc(self.report.resumed)
        counts.items_retried.inc(self.report.crashed)
        if work is None:
            log.info("%s: %s", self.where, self.report.note or self.report.job_status)
            return None
        self._items = len(work.items)
        self.keeper = ChunkKeeper(self.sessions, self.settings, self.job_id, self.start,
                                  self.end, self.owner, self.price, leased_at=leased_at,
                                  on_give_up=self.lives.record_give_up).start()
        return work

    def _open_in(self, s: Session, send_next: bool) -> Work | None:
        """In one transaction: the job's state, the lease, the takeover's settlement and
        the pending items."""
        report, job_id = self.report, self.job_id
        job = repo.get_job(s, job_id=job_id)
        if job is None:
            report.note = "job not found; chunk dropped"
            return None
        status = JobStatus(job.status)
        if status == JobStatus.cancelling:
            report.cancelled, report.job_status = self._cancel_in(s)
            return None
        if status.finished:  # e.g. a chunk re-sent after its job ended
            chunks.mark_done(s, job_id=job_id, start=self.start)
            report.skipped, report.job_status = self.end - self.start, status.value
            return None
        if job.pair != self.pair:
            raise RuntimeError(f"job {job_id} is for pair {job.pair!r}; this worker: "
                               f"{self.pair!r}")
        # the job's row before the chunk's, in the order a cancel takes them (its items,
        # then every chunk's counts): the other order deadlocked with a cancel of a job
        # whose first chunk was opening
        repo.start_job(s, job_id=job_id)
        before = chunks.lease(s, job_id=job_id, start=self.start)
        runs = chunks.claim(s, job_id=job_id, start=self.start, owner=self.owner,
                            ttl=self.settings.lease_seconds, price=self.price)
        if runs is None:
            report.skipped, report.job_status = self.end - self.start, status.value
            report.note = "another worker holds the chunk's lease"
            return None
        self._settle(s, before)
        rows = repo.pending_work(s, job_id=job_id, start=self.start, end=self.end)
        report.resumed = runs > 1 and bool(rows)
        if runs > self.settings.max_chunk_runs and rows:
            repo.lock_job(s, job_id=job_id)
            fail_pending(s, job_id, rows, f"chunk abandoned: {runs - 1} workers took it and "
                         f"none finished it (killed or crashed while running it)")
            report.failed = len(rows)
            chunks.release(s, job_id=job_id, start=self.start, end=self.end,
                           owner=self.owner, price=self.price)
            report.job_status = repo.settle_job(s, job_id=job_id).value
            report.note = f"abandoned after {runs - 1} runs that never finished"
            return None
        items = [ChunkItem(it.index, it.prompt, it.messages, it.params, it.attempts,
                           it.retries, it.crashes, it.error) for it in rows]
        turn = chunks.take_unsent(s, job_id=job_id, n=1) if send_next and runs == 1 else []
        return Work(dict(job.params), items, turn)

    def _settle(self, s: Session, before: chunks.Lease | None) -> None:
        """The items earlier runs left marked in flight: released where the run gave its
        lease up alive, else a crash each, and an attempt for an item alone in its batch
        only where the death is proven (glossary: crash)."""
        marked = repo.died_in_flight(s, job_id=self.job_id, start=self.start, end=self.end)
        if not marked:
            return
        owners = sorted({repo.mark_owner(launch) for launch in marked})
        gave_up = self.lives.gave_up(owners)
        recent = set()  # runs whose lease ran out less than a lease ago
        if before is not None and before.lapsed < self.settings.lease_seconds:
            recent.add(before.owner[-200:])
        maybe_alive = self.lives.announced(sorted(recent - gave_up))
        for launch, indices in marked.items():
            owner = repo.mark_owner(launch)
            if owner in gave_up:
                log.info("%s: items %s were in flight in a run that gave its lease up alive "
                         "(%s); released, not charged", self.where, indices, launch)
                repo.clear_launches(s, job_id=self.job_id, start=self.start, end=self.end,
                                    owner=owner)
                self.report.released += len(indices)
                continue
            proven = owner not in maybe_alive
            log.warning("%s: a run %s with items %s in flight (%s); they run alone",
                        self.where, "died" if proven else "stopped renewing its lease",
                        indices, launch)
            repo.record_crash(s, job_id=self.job_id, start=self.start, indices=indices,
                              why="its worker process stopped: killed, crashed, or "
                              "frozen past its lease and its presence" if proven
                              else "its run stopped renewing its lease (its process is "
                              "still announced: no attempt is counted)", attempt=proven)
            self.report.crashed += len(indices)

    # -- the engine's side (the keeper writes) --------------------------------------------

    def _kept(self) -> ChunkKeeper:
        if self.keeper is None:
            raise RuntimeError(f"{self.where}: the run is not open")
        return self.keeper

    def launch(self, indices: list[int], generation: int) -> None:
        """These items join a batch of the run's engine ``generation`` (ChunkKeeper.launch)."""
        self._kept().launch(indices, generation)

    def put(self, outcome: Outcome) -> None:
        """A finished item's outcome, written in the next batch."""
        self._kept().put(outcome)

    def failed(self, indices: list[int], error: str, generation: int | None = None) -> None:
        """An engine exception struck these items: an attempt each."""
        self._kept().failed(indices, error, generation)

    def out_of_memory(self, error: str) -> None:
        self._kept().out_of_memory(error)

    def crashed(self, indices: list[int], why: str) -> None:
        """The device is gone with these items in flight: a crash each."""
        self._kept().crashed(indices, why)

    def should_stop(self) -> bool:
        return self._kept().should_stop()

    # -- close ----------------------------------------------------------------------------

    def close(self, tally: Tally | None) -> ChunkReport:
        """Write what is left, give the lease back, cancel the chunk if its job is being
        cancelled. Raises if the database stays away past patience."""
        keeper, report = self._kept(), self.report
        try:
            keeper.close()
        finally:
            report.written, report.failed = keeper.report.written, tally.failed if tally else 0
            report.faults = tally.faults if tally else keeper.report.failures
            report.skipped = (self.end - self.start) - self._items + keeper.report.unwritten
            report.refused = keeper.report.refused
            report.job_status = keeper.report.job_status
        if keeper.cancelling.is_set():
            report.cancelled, report.job_status = retry_db(
                self._cancel, backoff=self.backoff, what=self.where)
        elif keeper.lost.is_set():
            report.note = "lease taken over by another worker"
        elif keeper.gave_up.is_set():
            report.note = "lease given up (no renewal for two thirds of it)"
        return report

    def _cancel(self) -> tuple[int, str]:
        with self.sessions.begin() as s:
            return self._cancel_in(s)

    def _cancel_in(self, s: Session) -> tuple[int, str]:
        """A cancelling job's chunk: its pending items are cancelled. (count, job status)"""
        repo.lock_job(s, job_id=self.job_id)
        n = repo.cancel_pending(s, job_id=self.job_id, start=self.start, end=self.end)
        chunks.mark_done(s, job_id=self.job_id, start=self.start)
        return n, repo.settle_job(s, job_id=self.job_id).value
