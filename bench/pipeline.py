"""`specq bench-pipeline`: what the job path costs over the engine alone, side by side.

On the same prompts and pair, in one run:
1. the engine alone, in this process (the pair loaded once, warmed up);
2. the real job path: Client.submit -> Redis -> a `specq worker` subprocess (started here,
   pair loaded before timing) -> outcomes in the configured database; wall time from the
   submit call to the job's stored finish (its last outcomes written);
3. submission throughput: a synthetic file of --submit-prompts chat lines, validated and
   stored (not sent), prompts per second;
4. result write throughput: --write-rows synthetic outcomes written the way a worker
   writes them (one transaction, batched), rows per second.
It writes jobs into the configured database (SPECQ_DATABASE_URL): point it at a scratch one.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from specq.api.argtypes import positive_int
from specq.api.client import Client
from specq.api.tokenizer import prompt_tokenizer
from specq.bench.prompts import load_prompts
from specq.configs.presets import get_preset
from specq.configs.settings import Settings, get_settings, subprocess_env
from specq.db import repository as repo
from specq.db.models import ItemStatus
from specq.db.outcomes import Outcome
from specq.schema.counters import Counters
from specq.schema.generation import Request
from specq.worker.pairs import load_pair

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default="smollm2-135m", help="model-pair preset")
    p.add_argument("--prompts", type=positive_int, default=64)
    p.add_argument("--max-new-tokens", type=positive_int, default=48)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--chunk-size", type=positive_int, default=None,
                   help="default: every prompt in one")
    p.add_argument("--submit-prompts", type=positive_int, default=20_000)
    p.add_argument("--write-rows", type=positive_int, default=5_000)
    p.add_argument("--output-dir", default="bench-out")


def start_worker(settings: Settings, pair: str, client: Client, log_path: Path,
                 timeout: float = 300) -> subprocess.Popen:
    """`specq worker --pair PAIR`, returned once it consumes the pair's queue."""
    log_file = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "specq.api.cli", "worker", "--pair", pair, "--loglevel", "warning"],
        env=subprocess_env(settings), stdout=log_file, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}; see {log_path}")
        if client.workers_for(pair):
            return proc
        time.sleep(1)
    proc.kill()
    raise TimeoutError(f"the worker did not come up in {timeout} s; see {log_path}")


def engine_alone(pair, messages: list[list[dict]], max_new: int, batch: int) -> tuple[float, list]:
    engine = pair.engine(max_batch_size=batch)
    engine.generate([Request(prompt="warm up", max_new_tokens=4)])
    engine.calibrate()  # as a worker does when it starts
    requests = [Request(id=i, messages=m, max_new_tokens=max_new) for i, m in enumerate(messages)]
    t0 = time.perf_counter()
    results = engine.generate(requests)
    return time.perf_counter() - t0, results


def submission_rate(client: Client, pair: str, n: int, path: Path) -> float:
    with path.open("w") as f:
        for i in range(n):
            line = {"custom_id": f"s{i}", "messages": [
                {"role": "user", "content": f"Rewrite formally: hey, order {i} is late again"}]}
            f.write(json.dumps(line) + "\n")
    warm = client.submit(str(path), pair=pair, enqueue=False, max_new_tokens=8)  # tokenizer
    t0 = time.perf_counter()
    job = client.submit(str(path), pair=pair, enqueue=False, max_new_tokens=8)
    rate = n / (time.perf_counter() - t0)
    for stored in (warm, job):  # stored only to be timed: no worker is to run them (a
        stored.cancel()  # queued job is sent by the reconciler, as if its producer died)
    return rate


def write_rate(client: Client, pair: str, n: int) -> float:
    job = client.submit([f"p{i}" for i in range(n)], pair=pair, enqueue=False, max_new_tokens=8)
    counters = Counters(draft_steps=8, proposed=32, accepted=6, target_passes=9,
                        new_tokens=24, accepted_by_position=[3, 2, 1],
                        steps_by_draft_length=[1, 0, 0, 0, 8], draft_time=0.1,
                        verify_time=0.2)
    outcomes = [Outcome(i, ItemStatus.completed, output="an output of a few words",
                        token_ids=list(range(24)), finish_reason="length", prompt_tokens=12,
                        counters=counters, worker="bench") for i in range(n)]
    t0 = time.perf_counter()
    with client.sessions.begin() as s:
        repo.lock_job(s, job_id=job.id)
        written = repo.write_outcomes(s, job_id=job.id, outcomes=outcomes)
        repo.settle_job(s, job_id=job.id)
    assert written == n
    return n / (time.perf_counter() - t0)


def bench_pipeline(args: argparse.Namespace) -> dict:
    settings = get_settings()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    client = Client(settings)
    messages = [[m.model_dump() for m in conv] for conv in load_prompts(args.prompts)]
    pair = load_pair(get_preset(args.pair, settings.presets_file), settings)
    t_engine, alone = engine_alone(pair, messages, args.max_new_tokens, args.batch_size)
    del pair

    worker_settings = settings.model_copy(update={"max_batch_size": args.batch_size})
    proc = start_worker(worker_settings, args.pair, client, out / "pipeline-worker.log")
    # a client loads the target's tokenizer once per process (seconds for a GGUF file):
    # do it before the clock starts, as for any client that has submitted before
    prompt_tokenizer(get_preset(args.pair, settings.presets_file), settings)
    try:
        submitted_at = datetime.now(timezone.utc)
        job = client.submit(messages, pair=args.pair, max_new_tokens=args.max_new_tokens,
                            chunk_size=args.chunk_size or len(messages))
        # poll gently: this process must not take the CPU from the worker it measures
        state = job.wait(progress=False, poll=0.5)
        with client.sessions() as s:
            finished = repo.require_job(s, job_id=job.id).finished_at
        t_job = repo.elapsed(submitted_at, finished)  # submit call -> outcomes written
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    items = list(job.results())
    same = sum(it.output == r.text for it, r in zip(items, alone))
    report = {
        "pair": args.pair, "prompts": len(messages), "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size, "chunk_size": args.chunk_size or len(messages),
        "database": settings.sqlalchemy_url.split(":", 1)[0], "job_status": state.status,
        "engine_alone_s": t_engine, "job_path_s": t_job,
        "overhead_ratio": None if t_job is None else t_job / t_engine,
        "same_outputs": same, "engine_faults": state.engine_faults,
        "first_fault": state.first_fault,
        "submission_prompts_per_s": submission_rate(client, args.pair, args.submit_prompts,
                                                    out / "submit.jsonl"),
        "result_rows_written_per_s": write_rate(client, args.pair, args.write_rows),
    }
    (out / "pipeline.json").write_text(json.dumps(report, indent=2))
    return report


def run(args: argparse.Namespace) -> int:
    r = bench_pipeline(args)
    print(f"pair {r['pair']}: {r['prompts']} prompts x {r['max_new_tokens']} tokens, batch "
          f"{r['batch_size']}, chunk {r['chunk_size']}, database {r['database']}")
    print(f"engine alone           {r['engine_alone_s']:8.2f} s")
    print(f"job path (submit→done) {r['job_path_s']:8.2f} s   ratio {r['overhead_ratio']:.3f}")
    print(f"same outputs           {r['same_outputs']}/{r['prompts']}")
    print(f"submission             {r['submission_prompts_per_s']:8.0f} prompts/s")
    print(f"result writes          {r['result_rows_written_per_s']:8.0f} rows/s")
    print(f"written to {Path(args.output_dir) / 'pipeline.json'}")
    if r["engine_faults"]:  # a run that met faults measured a slow path: it fails
        print(f"engine faults: {r['engine_faults']} (first: {r['first_fault']})",
              file=sys.stderr)
    return 0 if r["job_status"] == "completed" and not r["engine_faults"] else 1
