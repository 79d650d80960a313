"""`specq bench-chaos`: one job through every fault the fault tests try one at a time.

A job of --items prompts runs on --workers worker subprocesses (real Redis, the configured
database: point SPECQ_DATABASE_URL at a scratch PostgreSQL). Each worker reaches Redis and
the database through a TCP proxy (bench/proxy.py) and runs an engine that fails on
request (bench/faults.py). While the job runs, at fixed points of its progress:
--kills SIGKILLs of a worker that holds a chunk (a new worker is started in its place, as a
supervisor would), a broker flush (FLUSHDB), a --outage s cut of every worker's database
link, one of their broker link, and --ooms injected CUDA out-of-memory errors. At the end:
items lost (pending), written twice, failed (none should: no fault here is an item's
fault), and for each kill the seconds until another worker held the dead worker's chunk.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from specq.api.client import Client
from specq.bench.proxy import Proxy
from specq.configs.settings import Settings, get_settings, subprocess_env
from specq.db import chunks
from specq.db.models import Chunk, Item, ItemStatus

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default="tiny")
    p.add_argument("--items", type=int, default=2000)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--ooms", type=int, default=2)
    p.add_argument("--outage", type=float, default=30.0, help="seconds of each outage")
    p.add_argument("--chunk-size", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--lease", type=float, default=10.0, help="SPECQ_LEASE_SECONDS of workers")
    p.add_argument("--reconcile-every", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench-out")


class Worker:
    """A worker subprocess with its own faults file."""

    def __init__(self, settings: Settings, pair: str, out: Path) -> None:

        self.name = f"chaos-{uuid.uuid4().hex[:6]}"
        self.log = out / f"{self.name}.log"
        self.faults = out / f"{self.name}.faults.json"
        self.faults.write_text("{}")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specq.bench.faults", str(self.faults), "--pair", pair,
             "-n", f"{self.name}@%h", "--loglevel", "warning"],
            env=subprocess_env(settings), stdout=self.log.open("w"), stderr=subprocess.STDOUT)


def run_chaos(args: argparse.Namespace) -> dict:
    base = get_settings()
    if make_url(base.sqlalchemy_url).get_backend_name() != "postgresql":
        raise RuntimeError("bench-chaos needs SPECQ_DATABASE_URL on PostgreSQL (a scratch one)")
    rng = random.Random(args.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    broker, db = make_url(base.broker_url), make_url(base.sqlalchemy_url)
    rproxy = Proxy(broker.host or "127.0.0.1", broker.port or 6379).start()
    pproxy = Proxy(db.host or "127.0.0.1", db.port or 5432).start()
    own = base.model_copy(update={
        "queue_prefix": f"chaos-{uuid.uuid4().hex[:6]}", "lease_seconds": args.lease,
        "db_timeout": min(base.db_timeout, max(1.0, args.lease / 3)),  # lease >= 3 calls
        "reconcile_every": args.reconcile_every, "reconcile_grace": args.reconcile_every,
        "visibility_timeout": 3600})
    via = own.model_copy(update={
        "broker_url": broker.set(port=rproxy.port).render_as_string(hide_password=False),
        "database_url": db.set(port=pproxy.port).render_as_string(hide_password=False)})
    client = Client(own)
    workers = [Worker(via, args.pair, out) for _ in range(args.workers)]
    _wait_ready(client, args.pair, len(workers))

    prompts = [f"Item {i}: rewrite politely, keeping every fact: the order {i} is late again "
               f"and nobody answers the phone" for i in range(args.items)]
    t0 = time.monotonic()
    job = client.submit(prompts, pair=args.pair, max_new_tokens=args.max_new_tokens,
                        chunk_size=args.chunk_size)
    # events at shares of the job's progress, in order
    # events at shares of the job's progress, in order: the kills first, spread out, then
    # the outages (progress jumps after a database outage: the workers went on generating)
    events = sorted(
        [(0.03 + 0.57 * k / max(1, args.kills), "kill") for k in range(args.kills)]
        + [(0.30, "flush"), (0.62, "db"), (0.75, "broker")]
        + [(0.10 + 0.35 * k / max(1, args.ooms), "oom") for k in range(args.ooms)])
    recoveries, timeline, version = [], [], 0
    for share, kind in events:
        while _done(client, job.id) < share * args.items:
            if job.status(check_workers=False).finished:
                break
            time.sleep(0.2)
        at = round(time.monotonic() - t0, 1)
        if kind == "kill":
            recoveries.append(_kill_one(client, job.id, workers, via, args, out, rng))
        elif kind == "flush":
            redis.Redis.from_url(own.broker_url).flushdb()
        elif kind in ("db", "broker"):
            proxy = pproxy if kind == "db" else rproxy
            proxy.cut()
            time.sleep(args.outage)
            proxy.restore()
        elif kind == "oom":  # one out-of-memory error, in one live worker
            version += 1
            _inject_oom(client, job.id, workers, version, rng)
        timeline.append({"at_s": at, "event": kind, "done": _done(client, job.id)})
        log.warning("chaos: %s at %.1f s", kind, at)
    state = job.wait(progress=False, poll=1.0, timeout=3600)
    wall = time.monotonic() - t0
    for w in workers:
        w.proc.terminate()
    for w in workers:
        w.proc.wait(60)
    rproxy.close()
    pproxy.close()
    with client.sessions() as s:
        counts = dict(s.execute(select(Item.status, func.count()).where(Item.job_id == job.id)
                                .group_by(Item.status)).all())
        twice = s.scalar(select(func.count()).where(Item.job_id == job.id, Item.writes > 1))
        attempts = s.scalar(select(func.sum(Item.attempts)).where(Item.job_id == job.id))
    logs = " ".join(p.read_text(errors="replace") for p in out.glob("chaos-*.log"))
    report = {
        "pair": args.pair, "items": args.items, "workers": args.workers,
        "chunk_size": args.chunk_size, "lease_seconds": args.lease,
        "reconcile_every": args.reconcile_every, "outage_s": args.outage,
        "job_status": state.status, "wall_s": round(wall, 1),
        "completed": counts.get(ItemStatus.completed.value, 0),
        "lost": counts.get(ItemStatus.pending.value, 0), "duplicated": twice,
        "wrongly_failed": counts.get(ItemStatus.failed.value, 0),
        "attempts_recorded": attempts or 0,
        "out_of_memory_seen": logs.count("CUDA out of memory"),
        "reconciler_runs_resending": logs.count("chunks re-sent"),
        "kill_recovery_s": recoveries, "events": timeline,
    }
    (out / "chaos.json").write_text(json.dumps(report, indent=2))
    return report


def _inject_oom(client: Client, job_id: int, workers: list[Worker], version: int,
                rng: random.Random) -> None:
    """Ask a worker running a chunk of the job for one out-of-memory error and wait (60 s
    at most) until it struck, asking another if that worker was killed first."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busy = _holding(client, job_id, workers)
        if not busy:
            time.sleep(0.1)
            continue
        target = rng.choice(busy)[1]
        seen = _ooms(target)
        target.faults.write_text(json.dumps({"version": version, "oom": 1}))
        while time.monotonic() < deadline and target.proc.poll() is None:
            if _ooms(target) > seen:
                return
            time.sleep(0.2)
    log.warning("chaos: the out-of-memory error was not seen within 60 s")


def _ooms(worker: Worker) -> int:
    return worker.log.read_text(errors="replace").count("CUDA out of memory")


def _holding(client: Client, job_id: int, workers: list[Worker]) -> list[tuple[int, Worker]]:
    """(chunk start, worker) of each chunk of the job a live worker holds."""
    with client.sessions() as s:
        held = s.execute(select(Chunk.start, Chunk.lease_owner).where(
            Chunk.job_id == job_id, Chunk.done.is_(False),
            Chunk.lease_owner.is_not(None))).all()
    return [(start, w) for start, owner in held for w in workers
            if owner is not None and owner.startswith(w.name + "@") and w.proc.poll() is None]


def _wait_ready(client: Client, pair: str, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(client.workers_for(pair) or []) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} workers did not come up in {timeout} s")
        time.sleep(1)


def _done(client: Client, job_id: int) -> int:
    return client.job(job_id).status(check_workers=False).ended


def _kill_one(client: Client, job_id: int, workers: list[Worker], via: Settings,
              args: argparse.Namespace, out: Path, rng: random.Random) -> float | None:
    """SIGKILL a worker holding a chunk of the job, start another in its place; seconds
    until another worker held that chunk (or it was done), None if it was never held."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        mine = _holding(client, job_id, workers)
        if mine:
            break
        if client.job(job_id).status(check_workers=False).finished:
            return None
        time.sleep(0.1)
    else:
        return None
    start, victim = rng.choice(mine)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    killed_at = time.monotonic()
    workers[workers.index(victim)] = Worker(via, args.pair, out)  # the supervisor
    while time.monotonic() - killed_at < 600:  # resumed elsewhere, or nothing left to do
        with client.sessions() as s:
            chunk = s.get(Chunk, (job_id, start), populate_existing=True)
            if chunk is None:
                raise RuntimeError(f"job {job_id}: chunk {start} is gone")
            left = chunks.pending_count(s, job_id=job_id, start=start, end=chunk.end)
            if not left or (chunk.lease_owner and
                            not chunk.lease_owner.startswith(victim.name + "@")):
                return round(time.monotonic() - killed_at, 1)
        time.sleep(0.1)
    return None


def run(args: argparse.Namespace) -> int:
    r = run_chaos(args)
    print(f"{r['items']} items on {r['pair']}, {r['workers']} workers, chunk {r['chunk_size']},"
          f" lease {r['lease_seconds']} s: job {r['job_status']} in {r['wall_s']} s")
    print("events: " + ", ".join(f"{e['event']}@{e['at_s']}s" for e in r["events"]))
    print(f"completed {r['completed']}  lost {r['lost']}  duplicated {r['duplicated']}  "
          f"wrongly failed {r['wrongly_failed']}  (out-of-memory errors met: "
          f"{r['out_of_memory_seen']}, item attempts recorded: {r['attempts_recorded']})")
    print(f"recovery after each kill (s): {r['kill_recovery_s']}")
    print(f"written to {Path(args.output_dir) / 'chaos.json'}")
    ok = r["job_status"] == "completed" and not (r["lost"] or r["duplicated"]
                                                  or r["wrongly_failed"])
    return 0 if ok else 1
