"""Real services for the pipeline: a fresh PostgreSQL database, a Redis DB and queue prefix
of this test session, and Celery workers started as `specq worker` subprocesses."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import update

from specq.api.client import Client, Job
from specq.broker.names import queue_name
from specq.configs.settings import Settings
from specq.db.models import Job as JobRow
from specq.db.session import migrate
from specq.worker.tiny import build_tiny_pair
from tests.conftest import fresh_pg_database

ROOT = Path(__file__).resolve().parents[2]

@pytest.fixture(scope="session")
def fleet_pg_url():
    """The fleets' own PostgreSQL database, not the session's pg_url: the session's workers
    live until its end, and their reconcilers settle any job of their database with no
    item pending (tests/db builds such jobs by hand in pg_url and reads them as built)."""
    with fresh_pg_database() as url:
        yield url


@pytest.fixture(scope="session")
def settings(fleet_pg_url, tmp_path_factory):
    """PostgreSQL + Redis settings; the queue prefix keeps this session's queues apart."""
    migrate(fleet_pg_url)
    data_dir = tmp_path_factory.mktemp("data")
    build_tiny_pair(data_dir / "tiny")
    prefix = f"specq-test-{uuid.uuid4().hex[:8]}"
    db = random.choice(redis_databases())
    yield Settings(database_url=fleet_pg_url, broker_url=f"redis://127.0.0.1:6379/{db}",
                   data_dir=data_dir, queue_prefix=prefix, visibility_timeout=10, chunk_size=25)
    r = redis.Redis(host="127.0.0.1", port=6379, db=db)
    keys = list(r.scan_iter(f"{prefix}*"))
    if keys:
        r.delete(*keys)


def redis_databases() -> list[int]:
    """The Redis databases this test process may take: 1-14 (15 is the tests' scratch one),
    split between pytest-xdist's processes, so one's broker flush never reaches another's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return list(range(1, 15))[int(worker.removeprefix("gw")) % 14::min(count, 14)]


def own_deployment(settings: Settings, name: str, **update: Any) -> Settings:
    """The settings of a deployment of the test's own, with ``update``: a queue prefix that
    no other test's workers or reconcilers act on, under the session's (so the session's
    clean-up deletes its Redis keys too)."""
    prefix = f"{settings.queue_prefix}-{name}-{uuid.uuid4().hex[:6]}"
    return settings.model_copy(update={"queue_prefix": prefix, **update})


def stored_unsent(client: Client, lines, **submit) -> Job:
    """A job stored with its queue and not one chunk sent: what a producer killed between
    committing a job and sending its chunks leaves (the reconciler sends them)."""
    job = client.submit(lines, enqueue=False, **submit)
    with client.sessions.begin() as s:
        s.execute(update(JobRow).where(JobRow.id == job.id)
                  .values(queue=queue_name(submit["pair"], client.settings)))
    return job


@pytest.fixture(scope="session")
def client(settings):
    return Client(settings)


# the settings a test may change that a subprocess must see too
PASSED_ON = ("database_url", "broker_url", "data_dir", "queue_prefix", "visibility_timeout",
             "max_batch_size", "max_attempts", "lease_seconds", "db_timeout", "reconcile_every",
             "reconcile_grace", "flush_every", "flush_items", "retry_backoff",
             "retry_backoff_max", "db_patience", "broker_timeout", "chunk_size",
             "dispatch_window", "metrics_port", "metrics_host", "device_hour_price",
             "consumer_stall")


def worker_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    env.update({f"SPECQ_{name.upper()}": str(getattr(settings, name)) for name in PASSED_ON
                if getattr(settings, name) is not None})
    return env


@pytest.fixture(scope="session")
def env_for():
    """settings -> the SPECQ_* environment of a CLI or worker subprocess."""
    return worker_env


class WorkerProcess:
    """`specq worker --pair PAIR` in a subprocess, its log in a file."""

    def __init__(self, settings: Settings, pair: str, name: str, log_dir: Path,
                 faults: Path | None = None, standin: bool = False) -> None:
        self.name = f"{name}-{uuid.uuid4().hex[:6]}"
        self.log = log_dir / f"{self.name}.log"
        # with a faults file, the engine fails as the file says (bench/faults.py);
        # a stand-in engine answers at once (bench/standin.py)
        start = (["-m", "specq.bench.faults", str(faults)] if faults
                 else ["-m", "specq.bench.standin", "--loglevel", "info"] if standin
                 else ["-m", "specq.api.cli", "worker"])
        self.proc = subprocess.Popen(
            [sys.executable, *start, "--pair", pair, "-n", f"{self.name}@%h"],
            cwd=ROOT, env=worker_env(settings), stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, client: Client, pair: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}:\n{self.output()}")
            if any(h.startswith(self.name + "@") for h in client.workers_for(pair) or []):
                return
            time.sleep(0.5)
        raise TimeoutError(f"worker not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        """The worker's log lines about chunks and errors (its model-loading noise left out)."""
        lines = [x for x in self.log.read_text().splitlines()
                 if any(k in x for k in ("chunk", "ERROR", "WARNING", "CRITICAL", "Traceback",
                                         "ready"))]
        return f"--- {self.name}\n" + "\n".join(lines[-60:]) + "\n"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # warm shutdown: finish the current chunk
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="session")
def start_worker(tmp_path_factory):
    """start_worker(settings, pair, name) -> a ready WorkerProcess, stopped at session end."""
    started: list[WorkerProcess] = []
    log_dir = tmp_path_factory.mktemp("workers")

    def start(settings: Settings, pair: str = "tiny", name: str = "w",
              faults: Path | None = None, ready: Settings | None = None,
              standin: bool = False, wait: bool = True) -> WorkerProcess:
        """``ready``: the settings to ask the broker through (the worker's may go through
        a proxy the test cuts); ``wait=False`` returns at once, as a supervisor restarts."""
        w = WorkerProcess(settings, pair, name, log_dir, faults, standin)
        started.append(w)
        if wait:
            w.wait_ready(Client(ready or settings), pair)
        return w

    yield start
    for w in started:  # all at once: a warm shutdown each, in parallel, 3 s at most (the
        if w.proc.poll() is None:  # session is over: a worker still busy then is killed;
            w.proc.terminate()  # waiting 10 s held the last test's process 5-10 s)
    deadline = time.monotonic() + 3
    for w in started:
        try:
            w.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()


@pytest.fixture(scope="session")
def tiny_worker(settings, start_worker):
    return start_worker(settings, "tiny", "tiny")


@pytest.fixture(scope="session")
def tiny_fixed_worker(settings, start_worker):
    """The tiny pair drafting at a fixed g: the adaptive engine rightly never drafts with
    the tiny pair (its draft costs what its target does), and a test of counters needs
    drafts."""
    return start_worker(settings, "tiny-fixed", "tiny-fixed")
