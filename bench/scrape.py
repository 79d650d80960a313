"""`specq bench-metrics`: what a Prometheus scrape costs, side by side with what it watches.

1. A worker: the pair generates a batch of prompts with the worker's metrics attached (its
   engine reports every step, its outcomes are counted as a worker counts them), then its
   /metrics page is rendered again and again. Printed: the median step time, the median
   render time, and their ratio (one scrape against one step; Prometheus scrapes every
   15 s, thousands of steps apart).
2. The control plane: a job of ``--items`` items is stored in the settings' database
   (SPECQ_DATABASE_URL; PostgreSQL for a figure that means something) and the exporter's
   collector is scraped over HTTP, as Prometheus does. Printed: the median scrape time.
   The job is deleted after (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
import urllib.request


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default="tiny-fixed", help="model-pair preset of the worker part")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--items", type=int, default=1_000_000,
                   help="items of the stored job the exporter is scraped beside (0: skip)")
    p.add_argument("--scrapes", type=int, default=50)
    p.add_argument("--keep", action="store_true", help="keep the stored job")


def worker_part(args: argparse.Namespace) -> None:
    from prometheus_client import generate_latest

    from specq.configs.presets import get_preset
    from specq.configs.settings import get_settings
    from specq.db.models import ItemStatus
    from specq.db.outcomes import Outcome
    from specq.schema.generation import Request
    from specq.worker.engine.step import Step
    from specq.worker.metrics import WorkerMetrics
    from specq.worker.pairs import load_pair

    settings = get_settings()
    preset = get_preset(args.pair, settings.presets_file)
    engine = load_pair(preset, settings).engine()
    metrics = WorkerMetrics(preset.name, preset.drafter, "bench@host")
    steps: list[float] = []

    def on_step(step: Step) -> None:
        metrics.step(step)
        steps.append(step.t_step)

    engine.on_step = on_step
    engine.generate([Request(prompt="Hello", max_new_tokens=2)])  # warm-up
    steps.clear()
    requests = [Request(prompt=f"Rewrite sentence {i}: the quick brown fox jumps over the "
                        f"lazy dog", max_new_tokens=args.max_new_tokens)
                for i in range(args.prompts)]
    results = engine.generate(requests)
    metrics.written([Outcome(i, ItemStatus.completed, prompt_tokens=r.prompt_tokens,
                             counters=r.counters) for i, r in enumerate(results)])
    renders = []
    for _ in range(max(args.scrapes, 200)):
        t0 = time.perf_counter()
        page = generate_latest(metrics.registry)
        renders.append(time.perf_counter() - t0)
    step, render = statistics.median(steps), statistics.median(renders)
    series = sum(1 for line in page.decode().splitlines() if line and line[0] != "#")
    print(f"worker ({preset.name}, batch {engine.max_batch_size}): {len(steps)} steps, median "
          f"step {step * 1e3:.2f} ms; /metrics ({series} series, {len(page)} bytes) renders in "
          f"{render * 1e3:.3f} ms (median of {len(renders)}): {render / step:.2%} of one step, "
          f"{render / 15:.5%} of a worker's time at one scrape per 15 s")


def exporter_part(args: argparse.Namespace) -> None:
    from prometheus_client import start_http_server

    from specq.api.exporter import registry
    from specq.configs.settings import get_settings
    from specq.db import chunks
    from specq.db import repository as repo
    from specq.db.models import Job, JobStatus
    from specq.db.session import migrate, session_factory

    settings = get_settings()
    migrate(settings.sqlalchemy_url)
    sessions = session_factory(settings.sqlalchemy_url)
    t0 = time.perf_counter()
    with sessions.begin() as s:
        job = repo.create_job(s, pair=args.pair, params={}, chunk_size=settings.chunk_size,
                              source=None, queue=None)
        rows = ({"index": i, "custom_id": None, "prompt": f"bench prompt {i}", "messages": None,
                 "params": None} for i in range(args.items))
        job.total = repo.insert_items(s, job_id=job.id, rows=rows, batch=10000)
        job.status = JobStatus.queued.value
        n_chunks = chunks.insert_chunks(s, job_id=job.id, total=job.total,
                                        chunk_size=settings.chunk_size)
        job_id = job.id
    print(f"stored a {args.items:,}-item job ({n_chunks:,} chunks of {settings.chunk_size}) "
          f"in {time.perf_counter() - t0:.1f} s")
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server, thread = start_http_server(port, addr="127.0.0.1", registry=registry(settings))
        url = f"http://127.0.0.1:{port}/metrics"
        urllib.request.urlopen(url, timeout=30).read()  # connections made, caches warm
        times = []
        for _ in range(args.scrapes):
            t0 = time.perf_counter()
            page = urllib.request.urlopen(url, timeout=30).read()
            times.append(time.perf_counter() - t0)
        server.shutdown()
        server.server_close()
        assert b"specq_unfinished_items" in page
        print(f"exporter: a scrape over HTTP with the {args.items:,}-item job stored: median "
              f"{statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms "
              f"({args.scrapes} scrapes; {settings.sqlalchemy_url.split(':')[0]})")
    finally:
        if not args.keep:
            with sessions.begin() as s:
                s.delete(s.get(Job, job_id))


def run(args: argparse.Namespace) -> int:
    worker_part(args)
    if args.items:
        exporter_part(args)
    return 0
