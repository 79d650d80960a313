"""One input that kills its worker whenever it is in a batch fails alone; its batch-mates
complete, each item is written once, across workers restarted by a supervisor.

Real Redis, PostgreSQL and `specq worker` subprocesses; the poison is injected
(bench/faults.py: a SIGKILL the worker sends itself mid-step, as a segfault would
end it). Leases of 3 s and a reconciler every second keep it short.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

from sqlalchemy import select

from specq.api.client import Client
from specq.db.models import Item, JobStatus
from tests.pipeline.conftest import own_deployment

PAIR, MARKER = "tiny-lookup", "POISON"


class Supervisor:
    """Restarts each worker that dies, as systemd or Kubernetes would."""

    def __init__(self, start, settings, faults) -> None:
        self.start, self.settings, self.faults = start, settings, faults
        self.workers = [start(settings, PAIR, f"p{i}", faults=faults) for i in range(2)]
        self.started = list(self.workers)
        self.restarts = 0
        self.shut_down: set[int] = set()  # pids that stop() had to SIGKILL
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for i, w in enumerate(self.workers):
                if w.proc.poll() is not None and not self._stop.is_set():
                    self.restarts += 1
                    # not waiting for ready: a restarted worker may take the poison and die
                    # before it is seen ready, and that death is counted too
                    self.workers[i] = self.start(self.settings, PAIR, f"p{i}r{self.restarts}",
                                                 faults=self.faults, wait=False)
                    self.started.append(self.workers[i])

    def stop(self) -> None:
        """All at once, the job over: a warm shutdown each, 10 s at most in all (a worker
        restarted late may still be loading its pair), then SIGKILL."""
        self._stop.set()
        self._thread.join()
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.terminate()
        deadline = time.monotonic() + 10
        for w in self.workers:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.shut_down.add(w.proc.pid)  # killed here, not by the poison
                w.kill()

    def output(self) -> str:
        return "".join(w.output() for w in self.started)

    @property
    def killed(self) -> int:
        """Workers that died by the poison's SIGKILL (the supervisor may not have seen the
        last one yet when the job ends)."""
        return sum(w.proc.poll() == -signal.SIGKILL and w.proc.pid not in self.shut_down
                   for w in self.started)


def test_an_input_that_kills_its_worker_fails_alone_and_its_batch_mates_complete(
        settings, start_worker, tmp_path):
    own = own_deployment(
        settings, "poison", lease_seconds=3.0, db_timeout=1.0, reconcile_every=1.0,
        reconcile_grace=1.0, retry_backoff=0.2, retry_backoff_max=1.0, flush_every=0.3,
        max_attempts=2, max_batch_size=8)
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"version": 1, "poison": MARKER, "poison_kind": "kill"}))
    fleet = Supervisor(start_worker, own, faults)
    client = Client(own)
    prompts = [f"item {i}: rewrite the quick brown fox jumps over the lazy dog"
               for i in range(40)]
    prompts[17] = f"item 17: {MARKER} in this prompt kills the worker"
    try:
        t0 = time.monotonic()
        job = client.submit(prompts, pair=PAIR, max_new_tokens=8, chunk_size=8)
        state = job.wait(progress=False, timeout=300)
        seconds = time.monotonic() - t0
    finally:
        fleet.stop()
    assert state.status == JobStatus.completed.value, fleet.output()
    with client.sessions() as s:
        rows = s.execute(select(Item.index, Item.status, Item.writes, Item.error, Item.crashes,
                                Item.attempts)
                         .where(Item.job_id == job.id).order_by(Item.index)).all()
    failed = [r.index for r in rows if r.status == "failed"]
    assert failed == [17], fleet.output()
    assert all(r.status == "completed" for r in rows if r.index != 17)
    assert all(r.writes == 1 for r in rows)  # nothing written twice
    poison = rows[17]
    assert poison.error.startswith(f"killed or crashed its worker {poison.crashes} times"), \
        poison.error
    assert poison.attempts == own.max_attempts and poison.crashes > own.max_attempts - 1
    assert fleet.killed == poison.crashes >= own.max_attempts  # each death was the poison's
    state = job.status(check_workers=False)
    assert state.engine_faults == fleet.killed  # every death counted on its chunk
    assert "in flight" in state.first_fault
    assert state.items_isolated >= 2  # the poison's batch-mates finished alone
    print(f"\n40 items, 1 poison: {len(failed)} failed, {len(rows) - len(failed)} completed in "
          f"{seconds:.1f} s, {fleet.killed} workers killed, {fleet.restarts} restarted")
