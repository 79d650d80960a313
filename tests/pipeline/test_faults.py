"""Fault injection with real Redis, PostgreSQL and worker subprocesses: every job ends
with each item written exactly once, none wrongly failed, whatever fails on the way.

The fleet: two prompt-lookup workers and one draft-model worker, each reaching Redis and
PostgreSQL through a TCP proxy the tests can cut (bench/proxy.py) and running with
an engine that fails on request (bench/faults.py). Leases of 3 s and a reconciler
every second keep the suite short; the production defaults are 30 s and 15 s. The fleet
is the module's, and every test finds it the same (both links up, no fault planned, the
three workers alive and no other), whatever the tests before it did: a test that needs a
worker to die starts one of its own.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from sqlalchemy import select
from sqlalchemy.engine import make_url

from specq.api.client import Client
from specq.bench.proxy import Proxy
from specq.db import chunks
from specq.db.models import Chunk, Item, ItemStatus, JobStatus
from tests.pipeline.conftest import ROOT, own_deployment, worker_env

LOOKUP, DRAFT = "tiny-lookup", "tiny"
BASE = {"a": LOOKUP, "b": LOOKUP, "d": DRAFT}  # the workers every test finds


class Fleet:
    def __init__(self, settings, start_worker, tmp: Path) -> None:
        self.redis = Proxy("127.0.0.1", 6379).start()
        self.pg = Proxy("127.0.0.1", 5432).start()
        self.own = own_deployment(
            settings, "faults", visibility_timeout=3600, lease_seconds=3.0, db_timeout=1.0,
            reconcile_every=1.0, reconcile_grace=2.0, retry_backoff=0.2, retry_backoff_max=2.0,
            flush_every=0.3, broker_timeout=3.0, consumer_stall=8.0)
        db = self.own.broker_url.rsplit("/", 1)[1]
        self.via = self.own.model_copy(update={
            "broker_url": f"redis://127.0.0.1:{self.redis.port}/{db}",
            "database_url": make_url(self.own.database_url).set(port=self.pg.port)
            .render_as_string(hide_password=False)})
        self.client = Client(self.own)
        self.tmp = tmp
        self.start_worker = start_worker
        self.workers = {}
        self.versions: dict[str, int] = {}

    def start(self, name: str, pair: str):
        self.workers[name] = self.start_worker(self.via, pair, name, faults=self.tmp / name,
                                               ready=self.own)
        return self.workers[name]

    def faults(self, name: str, **plan) -> None:
        self.versions[name] = self.versions.get(name, 0) + 1
        (self.tmp / name).write_text(json.dumps({"version": self.versions[name], **plan}))

    def output(self) -> str:
        return "".join(w.output() for w in self.workers.values())

    def reset(self) -> None:
        """The fleet as every test finds it: both links up, no fault planned, the base
        workers alive (one that died is started again) and no other."""
        self.redis.restore()
        self.pg.restore()
        for name in [n for n in self.workers if n not in BASE]:
            self.workers.pop(name).stop()
        for name, pair in BASE.items():
            self.faults(name)  # a new plan of nothing: what an earlier one left is dropped
            if name not in self.workers or self.workers[name].proc.poll() is not None:
                self.start(name, pair)

    def close(self) -> None:
        self.redis.close()
        self.pg.close()


@pytest.fixture(scope="module")
def module_fleet(settings, start_worker, tmp_path_factory):
    f = Fleet(settings, start_worker, tmp_path_factory.mktemp("faults"))
    for name, pair in BASE.items():
        f.start(name, pair)
    yield f
    for w in f.workers.values():
        w.stop()
    f.close()


@pytest.fixture
def fleet(module_fleet):
    """The module's fleet, put back as it was after each test (Fleet.reset)."""
    yield module_fleet
    module_fleet.reset()


def prompts(n: int, tag: str) -> list[str]:
    return [f"{tag} {i}: rewrite the quick brown fox jumps over the lazy dog" for i in range(n)]


def exactly_once(fleet: Fleet, job, total: int, timeout: float = 180) -> None:
    """The job completed; every item written exactly once; none failed."""
    state = job.wait(progress=False, timeout=timeout)
    assert state.status == JobStatus.completed.value, fleet.output()
    with fleet.client.sessions() as s:
        rows = s.execute(select(Item.index, Item.status, Item.writes, Item.error)
                         .where(Item.job_id == job.id).order_by(Item.index)).all()
    assert [r.index for r in rows] == list(range(total))
    lost = [r.index for r in rows if r.status == ItemStatus.pending.value]
    failed = [(r.index, r.error) for r in rows if r.status == ItemStatus.failed.value]
    twice = [r.index for r in rows if r.writes != 1]
    assert (lost, failed, twice) == ([], [], []), fleet.output()


def wait_for(predicate, timeout: float, what: str, fleet: Fleet) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"{what} after {timeout} s\n" + fleet.output()
        time.sleep(0.1)
    return time.monotonic() - t0


def done(job) -> int:
    return job.status(check_workers=False).ended


def test_engine_faults_fail_nothing_and_poison_no_later_job(fleet):
    """Out-of-memory and other engine errors on both pairs: retried, none fails, and the
    next job on the same workers runs clean (the engine state is rebuilt)."""
    for name in ("a", "b", "d"):
        fleet.faults(name, oom=1, error=2)
    jobs = [(fleet.client.submit(prompts(48, f"faults {pair}"), pair=pair, max_new_tokens=10,
                                 chunk_size=8), pair) for pair in (LOOKUP, DRAFT)]
    for job, _ in jobs:
        exactly_once(fleet, job, 48)
    with fleet.client.sessions() as s:
        attempts = s.scalars(select(Item.attempts).where(
            Item.job_id.in_([j.id for j, _ in jobs]))).all()
    assert sum(attempts) > 0, "no fault was injected"
    for pair in (LOOKUP, DRAFT):
        after = fleet.client.submit(prompts(24, f"after {pair}"), pair=pair, max_new_tokens=10,
                                    chunk_size=8)
        exactly_once(fleet, after, 24)


def test_a_broker_flush_mid_job_loses_nothing(fleet):
    job = fleet.client.submit(prompts(200, "flush"), pair=LOOKUP, max_new_tokens=16,
                              chunk_size=10)
    wait_for(lambda: done(job) >= 20, 120, "no progress", fleet)
    r = redis.Redis.from_url(fleet.own.broker_url)
    r.flushdb()  # every queued chunk, every unacked one: gone
    r.close()
    exactly_once(fleet, job, 200)


def test_a_producer_killed_between_commit_and_send_loses_nothing(fleet):
    # the job and its first turn are committed, then the process dies before it sends them
    code = ("import os, signal; from specq.api import client; "
            "client.Job.deliver = lambda job, refs: (print(job.id, flush=True), "
            "os.kill(os.getpid(), signal.SIGKILL)); "
            "client.Client().submit([f'killed producer {i}' for i in range(40)], "
            "pair='tiny-lookup', max_new_tokens=8, chunk_size=10)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=worker_env(fleet.own),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    exactly_once(fleet, fleet.client.job(int(out.stdout.split()[0])), 40)


@pytest.mark.parametrize("link", ["redis", "pg"])
def test_a_cut_of_four_leases_between_workers_and_a_server_loses_nothing(fleet, link):
    """The link is cut for 12 s: four of the fleet's 3 s leases and twelve database-call
    bounds, so every run on it gives its lease up and the chunks are taken over."""
    job = fleet.client.submit(prompts(240, f"cut {link}"), pair=LOOKUP, max_new_tokens=16,
                              chunk_size=12)
    wait_for(lambda: done(job) >= 24, 120, "no progress", fleet)
    proxy = getattr(fleet, link)
    proxy.cut()
    cut_at = done(job)
    time.sleep(12)
    proxy.restore()
    exactly_once(fleet, job, 240)
    assert cut_at < 240, "the job ended before the cut: it tested nothing"
    assert all(w.proc.poll() is None for w in fleet.workers.values()), fleet.output()


def test_a_broker_stall_while_workers_ack_leaves_no_consumer_wedged(fleet):
    """The broker link stalls for 10 s while the fleet runs a job: a worker acknowledging a
    chunk then had its consumer left wedged for good (kombu logs "Couldn't ack" and never
    polls again; the job stood still for minutes). The consumer watch restarts such a
    worker (worker/watch.py) and the job completes, exactly once."""
    job = fleet.client.submit(prompts(160, "stall broker"), pair=LOOKUP, max_new_tokens=16,
                              chunk_size=8)
    wait_for(lambda: done(job) >= 16, 120, "no progress", fleet)
    fleet.redis.stall()
    stalled_at = done(job)
    time.sleep(10)
    fleet.redis.restore()
    exactly_once(fleet, job, 160)
    assert stalled_at < 160, "the job ended before the stall: it tested nothing"
    assert all(w.proc.poll() is None for w in fleet.workers.values()), fleet.output()


def test_submit_says_so_when_the_broker_is_down_or_hung_and_the_job_still_runs(fleet):
    closed = fleet.own.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
    t0 = time.monotonic()
    job = Client(closed).submit(prompts(30, "broker down"), pair=LOOKUP, max_new_tokens=8,
                                chunk_size=10)
    assert time.monotonic() - t0 < 15
    assert "cannot be reached" in job.enqueue_error
    # stored and not failed; the fleet's reconciler may already have sent it and a worker
    # started it
    assert job.status(check_workers=False).status in (JobStatus.queued.value,
                                                      JobStatus.in_progress.value)

    hung = Proxy("127.0.0.1", 6379).start()
    hung.hang()  # accepts connections, never answers
    env = worker_env(fleet.own.model_copy(update={
        "broker_url": f"redis://127.0.0.1:{hung.port}/0"}))
    (fleet.tmp / "hung.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in prompts(30, "broker hung")))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "specq.api.cli", "submit",
                          str(fleet.tmp / "hung.jsonl"), "--pair", LOOKUP,
                          "--max-new-tokens", "8", "--chunk-size", "10"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    submit_s = time.monotonic() - t0
    assert out.returncode == 0 and "cannot be reached" in out.stderr, out.stderr
    hung_id = int(out.stdout.split()[1].rstrip(":"))
    t0 = time.monotonic()
    status = subprocess.run([sys.executable, "-m", "specq.api.cli", "status", str(hung_id)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    status_s = time.monotonic() - t0
    hung.close()
    assert status.returncode == 0 and json.loads(status.stdout)["id"] == hung_id, status.stderr
    assert submit_s < 30 and status_s < 20, (submit_s, status_s)
    # the reconciler (the workers run it every second here) sends both once it can
    exactly_once(fleet, job, 30)
    exactly_once(fleet, fleet.client.job(hung_id), 30)


def test_a_lost_device_makes_its_worker_exit_and_another_finishes(fleet):
    fleet.faults("e", device=1)  # the plan is armed once the worker is ready
    e = fleet.start("e", LOOKUP)
    job = fleet.client.submit(prompts(60, "device"), pair=LOOKUP, max_new_tokens=12,
                              chunk_size=6)
    wait_for(lambda: e.proc.poll() is not None, 120, "worker e did not exit", fleet)
    assert e.proc.returncode == 75  # EX_TEMPFAIL: its supervisor restarts it
    assert "the device is unusable" in e.log.read_text()
    exactly_once(fleet, job, 60)


def test_kill_9_mid_chunk_another_worker_resumes_it_within_a_minute(fleet):
    """visibility_timeout is an hour here: the lease, not the broker, brings the chunk
    back; items the killed worker wrote stay as they were, written once."""
    c = fleet.start("c", LOOKUP)
    job = fleet.client.submit(prompts(320, "kill"), pair=LOOKUP, max_new_tokens=24,
                              chunk_size=16)

    held: list[int] = []  # the chunk c held when the wait saw it (it may end right after)

    def c_holds_a_chunk() -> bool:
        with fleet.client.sessions() as s:
            row = s.execute(select(Chunk.start).where(
                Chunk.job_id == job.id, Chunk.lease_owner.like(f"{c.name}@%"),
                Chunk.done.is_(False))).first()
        held[:] = [] if row is None else [row.start]
        return bool(held)

    wait_for(lambda: done(job) >= 16 and c_holds_a_chunk(), 120, "c ran nothing", fleet)
    start = held[0]
    c.kill()
    resumed = wait_for(lambda: _resumed(fleet, job.id, start, c.name), 60,
                       "the killed worker's chunk was not resumed", fleet)
    exactly_once(fleet, job, 320)
    with fleet.client.sessions() as s:
        by = s.scalars(select(Item.worker).where(Item.job_id == job.id)).all()
    lookup = {w.name for name, w in fleet.workers.items() if name in ("a", "b", "c")}
    assert {w.split("@")[0] for w in by} <= lookup
    print(f"chunk [{start}, {start + 16}) resumed {resumed:.1f} s after kill -9")


def _resumed(fleet: Fleet, job_id: int, start: int, dead: str) -> bool:
    """Another worker holds the dead worker's chunk, or nothing of it is left to do (the
    dead worker had written every item before it was killed)."""
    with fleet.client.sessions() as s:
        chunk = s.get(Chunk, (job_id, start), populate_existing=True)
        left = chunks.pending_count(s, job_id=job_id, start=start, end=chunk.end)
        return not left or (chunk.lease_owner is not None
                            and not chunk.lease_owner.startswith(dead + "@"))
