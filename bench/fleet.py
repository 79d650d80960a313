"""`specq bench-fleet`: the control plane at scale, with the engine taken out of the way.

One job of --items prompts goes through the real path: Client.submit (validate, store,
send) -> Redis -> --workers worker subprocesses -> outcomes in the configured database
(PostgreSQL: point SPECQ_DATABASE_URL at a scratch database). The workers' engine is a
stand-in that answers every prompt at once with one token (bench/standin.py), or,
with --engine real, the pair's own engine (use --max-new-tokens 1 and the tiny pairs).
--small-at seconds after the big job is stored, a --small-items job is submitted behind it:
how long it takes shows whether jobs share the workers.

Reported: submit rate; end-to-end and processing rates; how long chunk messages waited
(sent -> first lease); status, metrics and export times at that size, in this process
and as `specq status` / `specq metrics` commands; exactly-once (every item written once);
each process's peak memory and the workers' memory over the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from specq.api import formats
from specq.api.argtypes import positive_int
from specq.api.client import Client
from specq.api.client import Job as JobHandle
from specq.broker.names import PRIORITIES
from specq.configs.settings import Settings, get_settings, subprocess_env
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import Chunk, Item, ItemStatus, Job, JobStatus

log = logging.getLogger(__name__)

POLL = 2.0  # seconds between looks at the jobs and the workers' memory


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--items", type=positive_int, default=100_000)
    p.add_argument("--workers", type=positive_int, default=4)
    p.add_argument("--engine", choices=("standin", "real"), default="standin",
                   help="standin: answers at once (default); real: the pair's engine")
    p.add_argument("--pair", default="tiny-lookup")
    p.add_argument("--chunk-size", type=positive_int, default=500)
    p.add_argument("--max-new-tokens", type=positive_int, default=1)
    p.add_argument("--small-items", type=positive_int, default=100)
    p.add_argument("--small-at", type=float, default=30.0,
                   help="seconds after the big job is stored (negative: no small job)")
    p.add_argument("--small-priority", choices=list(PRIORITIES), default="normal")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this long")
    p.add_argument("--output-dir", default="bench-out")


@dataclass
class FleetWorker:
    """One worker subprocess and its memory over the run."""

    name: str
    proc: subprocess.Popen
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (items done, MB)

    def sample(self, done: int) -> None:
        rss = _proc_kb(self.proc.pid, "VmRSS")
        if rss is not None:
            self.rss_mb.append((done, rss / 1024))

    def peak_mb(self) -> float | None:
        peak = _proc_kb(self.proc.pid, "VmHWM")
        return None if peak is None else peak / 1024


def _proc_kb(pid: int, key: str) -> int | None:
    """A /proc/PID/status figure in kB (Linux); None once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def start_workers(settings: Settings, args: argparse.Namespace, client: Client, out: Path,
                  timeout: float = 300) -> list[FleetWorker]:
    env = subprocess_env(settings)
    if settings.torch_threads <= 0:  # a share of the cores each: these workers start as
        # `python -m specq.bench.standin`, which worker/threads.py does not count, so each
        # would take every core and spin its threads against the others'
        # (docs/benchmarks.md#2026-11-30-torch-threads)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        env["SPECQ_TORCH_THREADS"] = str(max(1, cores // args.workers))
    workers = []
    for i in range(args.workers):
        name = f"fleet{i}@{os.uname().nodename}"
        log_file = (out / f"fleet-worker-{i}.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "specq.bench.standin", "--pair", args.pair,
             "--engine", args.engine, "-n", name],
            env=env, stdout=log_file, stderr=subprocess.STDOUT)
        workers.append(FleetWorker(name, proc))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [w for w in workers if w.proc.poll() is not None]
        if dead:
            stop_workers(workers)
            raise RuntimeError(f"worker {dead[0].name} exited; see {out}")
        ready = set(client.workers_for(args.pair) or [])
        if all(w.name in ready for w in workers):
            return workers
        time.sleep(1)
    stop_workers(workers)
    raise TimeoutError(f"the workers did not come up in {timeout} s; see {out}")


def stop_workers(workers: list[FleetWorker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        try:
            w.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            w.proc.kill()


def write_prompts(path: Path, n: int, tag: str) -> None:
    """n short labelling prompts, one JSONL line each."""
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"{tag}-{i}",
                                "prompt": f"Label the sentiment of review {i}: fine"}) + "\n")


def _timed(call: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = call()
    return time.perf_counter() - t0, value


def _cli_seconds(settings: Settings, *argv: str) -> float:
    """Wall seconds of a `specq` command, start-up included."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "specq", *argv], env=subprocess_env(settings),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def waits(client: Client, job_id: int) -> dict[str, float | None]:
    """Seconds each of the job's chunks waited between its message and its first lease."""
    c = Chunk.__table__.c
    with client.sessions() as s:
        rows = s.execute(select(c.leased_at - c.sent_at).where(
            c.job_id == job_id, c.leased_at.is_not(None), c.sends == 1)).scalars().all()
    rows = sorted(max(0.0, float(r)) for r in rows)
    if not rows:
        return {"p50": None, "p95": None, "max": None}
    return {"p50": statistics.median(rows), "p95": rows[int(0.95 * (len(rows) - 1))],
            "max": rows[-1]}


def progress(client: Client, job_id: int) -> tuple[bool, int]:
    """(whether the job is finished, its items no longer pending), from its chunks' counts:
    a light look, so that watching does not load the database it measures."""
    c = Chunk.__table__.c
    with client.sessions() as s:
        status = s.scalar(select(Job.status).where(Job.id == job_id))
        done = s.execute(select(func.coalesce(func.sum(c.completed + c.failed + c.cancelled), 0))
                         .where(c.job_id == job_id)).scalar_one()
    return JobStatus(status).finished, int(done)


def exactly_once(client: Client, job_id: int) -> dict[str, Any]:
    with client.sessions() as s:
        row = s.execute(select(
            func.count(),
            func.sum(Item.writes),
            func.count().filter(Item.writes > 1),
            func.count().filter(Item.status != ItemStatus.completed.value),
        ).where(Item.job_id == job_id)).one()
        faults, first, isolated = chunks.faults(s, job_id=job_id)
    return {"items": row[0], "writes": int(row[1] or 0), "written_twice": row[2],
            "not_completed": row[3], "engine_faults": faults, "first_fault": first,
            "items_isolated": isolated}


def _job_times(client: Client, job_id: int) -> tuple[Any, Any, Any]:
    with client.sessions() as s:
        job = repo.require_job(s, job_id=job_id)
        return job.created_at, job.started_at, job.finished_at


def bench_fleet(args: argparse.Namespace) -> dict[str, Any]:
    settings = get_settings()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    client = Client(settings)
    database = settings.sqlalchemy_url.split(":", 1)[0]
    big_file, small_file = out / "fleet-big.jsonl", out / "fleet-small.jsonl"
    write_prompts(big_file, args.items, "big")
    write_prompts(small_file, args.small_items, "small")
    workers = start_workers(settings, args, client, out)
    report: dict[str, Any] = {
        "items": args.items, "workers": args.workers, "engine": args.engine, "pair": args.pair,
        "chunk_size": args.chunk_size, "dispatch_window": settings.dispatch_window,
        "database": database, "cores": os.cpu_count()}
    try:
        t_submit, big = _timed(lambda: client.submit(
            str(big_file), pair=args.pair, chunk_size=args.chunk_size,
            max_new_tokens=args.max_new_tokens))
        stored_at = time.monotonic()
        report["submit_s"] = t_submit
        report["submit_items_per_s"] = args.items / t_submit
        small: JobHandle | None = None
        done = 0
        while True:
            now = time.monotonic()
            if now - stored_at > args.timeout:
                raise TimeoutError(f"job {big.id} not finished after {args.timeout} s")
            if small is None and args.small_at >= 0 and now - stored_at >= args.small_at:
                small = client.submit(str(small_file), pair=args.pair,
                                      chunk_size=args.chunk_size,
                                      max_new_tokens=args.max_new_tokens,
                                      priority=args.small_priority)
                report["small_submitted_after_s"] = now - stored_at
            finished, done = progress(client, big.id)
            for w in workers:
                w.sample(done)
            if any(w.proc.poll() is not None for w in workers):
                raise RuntimeError(f"a worker exited; see {out}")
            small_done = small is None or progress(client, small.id)[0]
            if small is not None and small_done and "big_pending_at_small_done" not in report:
                report["big_pending_at_small_done"] = args.items - done
            if finished and small_done:
                break
            time.sleep(POLL)
        report["worker_peak_mb"] = [w.peak_mb() for w in workers]
        report["worker_rss_mb"] = {w.name: _flatness(w.rss_mb) for w in workers}
    finally:
        stop_workers(workers)

    created, started, finished = _job_times(client, big.id)
    report["job_id"] = big.id
    report["end_to_end_items_per_s"] = args.items / repo.elapsed(created, finished)
    report["processing_items_per_s"] = args.items / repo.elapsed(started, finished)
    report["processing_s"] = repo.elapsed(started, finished)
    report["chunk_wait_s"] = waits(client, big.id)
    report["exactly_once"] = exactly_once(client, big.id)
    if small is not None:
        s_created, s_started, s_finished = _job_times(client, small.id)
        report["small_job"] = {
            "id": small.id, "priority": args.small_priority,
            "started_after_s": repo.elapsed(s_created, s_started),
            "completed_after_s": repo.elapsed(s_created, s_finished),
            "big_job_pending_when_it_was_seen_done": report.pop("big_pending_at_small_done"),
            "exactly_once": exactly_once(client, small.id)}
    t_status, _ = _timed(lambda: big.status(check_workers=False))
    t_metrics, _ = _timed(big.metrics)
    t_export, n = _timed(lambda: formats.export(big, out / "fleet-export.jsonl"))
    report["status_s"], report["metrics_s"], report["export_s"] = t_status, t_metrics, t_export
    report["export_rows_per_s"] = n / t_export
    report["cli_status_s"] = _cli_seconds(settings, "status", str(big.id))
    report["cli_metrics_s"] = _cli_seconds(settings, "metrics", str(big.id))
    report["bench_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report["redis_peak_mb"] = _redis_peak_mb(settings)
    (out / "fleet.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def _flatness(samples: list[tuple[float, float]]) -> dict[str, float | None]:
    """A worker's RSS once a tenth, a quarter, half and three quarters of the job were
    done, at the end, and its highest."""
    if not samples:
        return {"at_10pct": None, "at_end": None}
    last_done = samples[-1][0] or 1
    out: dict[str, float | None] = {}
    for share in (10, 25, 50, 75):
        out[f"at_{share}pct"] = next((mb for d, mb in samples if d >= share / 100 * last_done),
                                     samples[-1][1])
    return {**out, "at_end": samples[-1][1], "max": max(mb for _, mb in samples)}


def _redis_peak_mb(settings: Settings) -> float | None:
    from specq.broker import connection

    try:
        client = connection.broker_client(settings)
        return client.info("memory")["used_memory_peak"] / 2**20
    except Exception:  # noqa: BLE001 (a figure only)
        return None


def run(args: argparse.Namespace) -> int:
    r = bench_fleet(args)
    once = r["exactly_once"]
    print(f"{r['items']} items, {r['workers']} workers ({r['engine']} engine, pair "
          f"{r['pair']}), chunks of {r['chunk_size']}, {r['dispatch_window']} messages per job "
          f"on the broker, {r['database']}, {r['cores']} cores")
    if r["engine"] == "standin":
        print("engine: a stand-in that answers each prompt at once with one token "
              "(bench/standin.py): these are the control plane's rates")
    print(f"submit (validate, store, send)  {r['submit_s']:8.1f} s  "
          f"{r['submit_items_per_s']:8.0f} items/s")
    print(f"processing (first lease → done) {r['processing_s']:8.1f} s  "
          f"{r['processing_items_per_s']:8.0f} items/s")
    print(f"end to end (submit → done)                {r['end_to_end_items_per_s']:8.0f} items/s")
    w = r["chunk_wait_s"]
    if w["p50"] is not None:
        print(f"chunk message wait (sent → lease)  p50 {w['p50']:.2f} s  p95 {w['p95']:.2f} s  "
              f"max {w['max']:.2f} s")
    print(f"exactly once: {once['items']} items, {once['writes']} writes, "
          f"{once['written_twice']} written twice, {once['not_completed']} not completed")
    if once["engine_faults"]:  # a run that met faults measured a slow path: it fails
        print(f"engine faults: {once['engine_faults']} (first: {once['first_fault']}); "
              f"{once['items_isolated']} items ran alone", file=sys.stderr)
    if "small_job" in r:
        sj = r["small_job"]
        print(f"small job ({r['small_job']['priority']}, submitted "
              f"{r['small_submitted_after_s']:.0f} s in): started after "
              f"{sj['started_after_s']:.1f} s, completed after {sj['completed_after_s']:.1f} s "
              f"(the big job had {sj['big_job_pending_when_it_was_seen_done']} items left)")
    print(f"status {r['status_s']:.3f} s, metrics {r['metrics_s']:.3f} s, export "
          f"{r['export_s']:.1f} s ({r['export_rows_per_s']:.0f} rows/s) in-process; "
          f"`specq status` {r['cli_status_s']:.2f} s, `specq metrics` {r['cli_metrics_s']:.2f} s")
    peaks = ", ".join(f"{m:.0f}" for m in r["worker_peak_mb"] if m is not None)
    print(f"peak memory MB: workers {peaks}; bench {r['bench_peak_mb']:.0f}; redis "
          f"{r['redis_peak_mb'] or float('nan'):.1f}")
    for name, f in r["worker_rss_mb"].items():
        if f["at_10pct"] is not None:
            print(f"  {name}: RSS MB at 10/25/50/75 % of the job {f['at_10pct']:.0f}, "
                  f"{f['at_25pct']:.0f}, {f['at_50pct']:.0f}, {f['at_75pct']:.0f}; at the end "
                  f"{f['at_end']:.0f} (max {f['max']:.0f})")
    print(f"written to {Path(args.output_dir) / 'fleet.json'}")
    ok = once["written_twice"] == 0 and once["not_completed"] == 0 and not once["engine_faults"]
    return 0 if ok else 1
