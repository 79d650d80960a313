"""A worker's life as others see it, with real workers (subprocesses), Redis and PostgreSQL:
its start is all or nothing, its presence is true while it is busy, a chunk that fails on
it before the engine counts and says why, and every key it leaves on Redis is namespaced."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import time

import pytest
import redis
from sqlalchemy import select, update

from specq.api.client import Client
from specq.broker import connection, dispatch
from specq.broker.names import queue_name
from specq.broker.reconciler import reconcile
from specq.db.models import Chunk, Item, Job, JobStatus
from tests.conftest import live_leases, wait_until
from tests.pipeline.conftest import ROOT, own_deployment, worker_env

log = logging.getLogger(__name__)


def test_a_worker_that_cannot_load_its_pair_exits_without_consuming(settings, tmp_path):
    own = own_deployment(settings, "start")
    client = Client(own)
    job = client.submit(["Correct: he go home"], pair="tiny-lookup", max_new_tokens=4)
    log_file = tmp_path / "worker.log"
    env = {**worker_env(own), "SPECQ_DEVICE": "cuda"}  # this torch is a CPU build
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "specq.api.cli", "worker", "--pair",
                           "tiny-lookup"], cwd=ROOT, env=env, stdout=log_file.open("w"),
                          stderr=subprocess.STDOUT, timeout=120)
    log.warning("the worker exited %d after %.1f s", proc.returncode, time.monotonic() - t0)
    text = log_file.read_text()
    assert proc.returncode == 1, text[-3000:]
    assert "pair tiny-lookup cannot start" in text and "built without CUDA" in text
    assert " ready." not in text and "ready in" not in text  # neither Celery's nor ours
    # the chunk's message is still waiting, untouched, and the job says why nothing runs
    r = connection.broker_client(own)
    assert (job.id, 0) in dispatch.held(r, [queue_name("tiny-lookup", own)], 0, own)
    r.close()
    with client.sessions() as s:
        assert s.scalar(select(Chunk.runs).where(Chunk.job_id == job.id)) == 0
    state = job.status()
    assert state.status == JobStatus.queued.value
    assert "no worker is consuming queue" in state.note, state.note
    assert "could not start" in state.note and "built without CUDA" in state.note
    job.cancel()


def test_a_ready_worker_logs_its_start_phases(tiny_worker):
    # Celery's own "ready." follows the worker's presence (announced once the pair is warm,
    # just before the consumer starts): wait for it, then read the order
    def logged() -> str | None:
        text = tiny_worker.log.read_text()
        return text if " ready." in text else None

    text = wait_until(logged, 60, "Celery's ready line")
    assert "pair tiny ready in" in text and "calibrate" in text, tiny_worker.output()
    assert text.index("pair tiny ready in") < text.index(" ready.")


def test_no_false_note_while_the_only_worker_is_busy(client, tiny_worker, env_for, tmp_path):
    """A solo worker in the middle of a long chunk answers no broadcast; its presence key
    says it is there all the same, and submit does not wait for it."""
    long = client.submit([f"Tell a long story number {i} about a fox" for i in range(64)],
                         pair="tiny", max_new_tokens=400, chunk_size=64)

    def lease() -> str | None:
        with client.sessions() as s:
            held = live_leases(s, job_id=long.id)
        return held[0][2] if held else None

    owner = wait_until(lease, 120, "the long chunk's lease")
    prompts = tmp_path / "p16.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Fix sentence {i}: he go home"}}\n'
                               for i in range(16)))
    checked, jobs = 0, []
    for _ in range(5):  # each check between two sightings of the same live lease
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "specq.api.cli", "submit", str(prompts),
                              "--pair", "tiny", "--max-new-tokens", "4"], cwd=ROOT,
                             env=env_for(client.settings), capture_output=True, text=True,
                             timeout=60)
        wall = time.perf_counter() - t0
        assert out.returncode == 0, out.stderr
        jobs.append(int(out.stdout.split()[1].rstrip(":")))
        state = client.job(jobs[-1]).status()
        if lease() != owner:
            break  # the long chunk ended: what follows proves nothing
        log.warning("specq submit of 16 lines with the worker busy: %.2f s", wall)
        assert "note" not in out.stdout, out.stdout
        assert state.note is None, state.note
        checked += 1
    assert checked >= 1, "the long chunk ended before any check"
    for job_id in [long.id, *jobs]:
        client.job(job_id).cancel()
    long.wait(progress=False, timeout=120)


def test_a_chunk_that_fails_before_the_engine_says_why_and_stops(settings, client,
                                                                  tiny_worker):
    """Its messages vanish without a lease; the worker keeps the error on the job, and the
    reconciler stops sending the chunk after max_chunk_runs sends."""
    own = settings.model_copy(update={"reconcile_grace": 0.0, "max_chunk_runs": 2})
    job = client.submit(["Correct: he go home"], pair="tiny-lookup", max_new_tokens=4,
                        enqueue=False)
    with client.sessions.begin() as s:  # routed to the tiny worker, which refuses it
        s.execute(update(Job).where(Job.id == job.id)
                  .values(queue=queue_name("tiny", settings)))
    assert job.enqueue()
    state = wait_until(lambda: (st := job.status(check_workers=False)).error and st, 60,
                   "the job's error")
    assert "failed on worker" in state.error and "is for pair 'tiny-lookup'" in state.error
    assert "SPECQ_MAX_CHUNK_RUNS" in state.note and state.status == JobStatus.queued.value

    def ended() -> bool:
        reconcile(own, job_id=job.id)
        return job.status(check_workers=False).finished

    wait_until(ended, 90, "the job's end", poll=0.3)
    state = job.status(check_workers=False)
    assert (state.failed, state.pending) == (1, 0)
    with client.sessions() as s:
        error = s.scalar(select(Item.error).where(Item.job_id == job.id))
        runs, sends = s.execute(select(Chunk.runs, Chunk.sends)
                                .where(Chunk.job_id == job.id)).one()
    assert error.startswith("chunk abandoned: sent 2 times") and "tiny-lookup" in error
    assert (runs, sends) == (0, 2)


@pytest.fixture
def own_redis(tmp_path):
    """A Redis server of this test alone, on a free port: every key in it is ours to see."""
    server = shutil.which("redis-server")
    assert server, "redis-server is needed"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    try:
        wait_until(lambda: _pings(r), 30, "redis-server")
        yield url
    finally:
        r.close()
        proc.terminate()
        proc.wait(30)


def _pings(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.ConnectionError:
        return False


def test_every_key_on_the_broker_is_behind_the_queue_prefix(settings, own_redis,
                                                            start_worker):
    own = own_deployment(settings, "ns", broker_url=own_redis)
    client = Client(own)
    worker = start_worker(own, "tiny-lookup", "ns")
    job = client.submit([f"Correct: he go home {i}" for i in range(30)], pair="tiny-lookup",
                        max_new_tokens=4, chunk_size=10)
    assert job.wait(progress=False, timeout=120).status == JobStatus.completed.value
    reconcile(own)
    r = redis.Redis.from_url(own_redis, decode_responses=True)
    keys = set(r.keys("*"))
    prefix = f"{own.queue_prefix}:"
    assert keys and all(k.startswith(prefix) for k in keys), sorted(keys)
    # Celery's and kombu's own keys are among them, not only specq's
    assert f"{prefix}_kombu.binding.{own.queue_prefix}.tiny-lookup" in keys, sorted(keys)
    assert [h.split("@")[0] for h in client.workers_for("tiny-lookup")] == [worker.name]
    worker.stop()  # a warm shutdown withdraws its presence at once
    assert worker.proc.returncode == 0
    assert client.workers_for("tiny-lookup") == []
    assert all(k.startswith(prefix) for k in r.keys("*"))
    r.close()
