"""What a job cost, with real workers: worker-seconds add up over chunks, a killed worker's
time is charged once (as spent, up to its last write or heartbeat, never the time nobody
held its chunk), and a cancelled job is charged for what it used."""

from __future__ import annotations

import signal
import time

import pytest
from sqlalchemy import func, select

from specq.api.client import Client
from specq.db.models import Chunk, Item, JobStatus
from specq.db.models import Job as JobRow

PAIR = "tiny-lookup"
PRICE = 3.6  # per device-hour: a thousandth a second


@pytest.fixture(scope="module")
def fleet(settings, start_worker):
    """Two priced workers on queues of their own, with leases of 3 s and a reconciler every
    second (the production defaults are 30 s and 15 s)."""
    own = settings.model_copy(update={
        "queue_prefix": settings.queue_prefix + "-costs", "visibility_timeout": 3600,
        "lease_seconds": 3.0, "db_timeout": 1.0, "reconcile_every": 1.0, "reconcile_grace": 2.0,
        "flush_every": 0.3, "flush_items": 1, "device_hour_price": PRICE})
    workers = [start_worker(own, PAIR, name) for name in ("x", "y")]
    return Client(own), workers


def prompts(n: int, tag: str) -> list[str]:
    return [f"{tag} {i}: rewrite the quick brown fox jumps over the lazy dog" for i in range(n)]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return found


def charged(client: Client, job_id: int) -> tuple[float, float | None]:
    """(worker_seconds, estimated_cost) of job_metrics."""
    m = client.job(job_id).metrics()
    return m.worker_seconds, m.estimated_cost


def test_a_killed_workers_time_is_charged_once_as_spent(fleet):
    client, (x, y) = fleet
    job = client.submit(prompts(320, "cost kill"), pair=PAIR, max_new_tokens=32, chunk_size=32)

    def x_has_charged_a_chunk():  # x holds a chunk it has charged (each write charges it)
        with client.sessions() as s:
            return s.execute(select(Chunk.start).where(
                Chunk.job_id == job.id, Chunk.lease_owner.like(f"{x.name}@%"),
                Chunk.done.is_(False), Chunk.held_seconds > 0)).first()

    # x is stopped (SIGSTOP) while it holds a chunk it has charged, then killed: stopped, it
    # can neither write nor finish, so what the chunk says then is what the kill leaves
    for _ in range(20):
        start = wait_for(x_has_charged_a_chunk, 120, "x charged no chunk\n" + x.output()).start
        x.proc.send_signal(signal.SIGSTOP)
        with client.sessions() as s:
            chunk = s.get(Chunk, (job.id, start))
            spent, lease_until, owner = chunk.held_seconds, chunk.lease_until, chunk.lease_owner
            done = chunk.done
        if owner and owner.startswith(x.name + "@") and not done:
            break
        x.proc.send_signal(signal.SIGCONT)  # it finished the chunk in between: the next one
    else:
        pytest.fail("x was never stopped holding a chunk\n" + x.output())
    x.kill()
    assert spent > 0
    state = job.wait(progress=False, timeout=180)
    assert state.status == JobStatus.completed.value, x.output() + y.output()

    with client.sessions() as s:
        chunk = s.get(Chunk, (job.id, start))
        total = s.scalar(select(func.sum(Chunk.held_seconds)).where(Chunk.job_id == job.id))
        leased = s.scalar(select(func.count()).where(Chunk.job_id == job.id,
                                                     Chunk.held_since.is_not(None)))
        span = s.execute(select(func.min(Item.started_at), func.max(Item.finished_at)).where(
            Item.job_id == job.id, Item.index >= start, Item.index < chunk.end,
            Item.worker.like(f"{y.name}@%"))).one()
        finished = s.get(JobRow, job.id).finished_at
    taken_over = chunk.held_seconds - spent
    # not lost: x's time stays on the chunk; the run that took it over adds its own, at
    # least from the first start to the last finish of the items it wrote
    if span[0] is not None:
        assert taken_over >= (span[1] - span[0]).total_seconds()
    # once: that run took the lease only after x's ran out, so it cannot have held the chunk
    # longer than from then to the job's end (charging the time nobody held it would)
    assert 0 < taken_over <= finished.timestamp() - lease_until
    seconds, cost = charged(client, job.id)
    assert leased == 0  # every run's charge ended with its release
    assert seconds == pytest.approx(total, rel=1e-12)  # the job's is the sum over its chunks
    assert cost == pytest.approx(seconds * PRICE / 3600, rel=1e-9)


def test_a_cancelled_job_is_charged_for_what_it_used(fleet):
    client, (_, y) = fleet
    job = client.submit(prompts(1000, "cost cancel"), pair=PAIR, max_new_tokens=24,
                        chunk_size=16)
    wait_for(lambda: job.status(check_workers=False).completed >= 16, 120,
             "nothing ran\n" + y.output())
    job.cancel()
    state = job.wait(progress=False, timeout=120)
    assert state.status == JobStatus.cancelled.value and state.cancelled > 0
    seconds, cost = charged(client, job.id)
    with client.sessions() as s:
        total = s.scalar(select(func.sum(Chunk.held_seconds)).where(Chunk.job_id == job.id))
    assert seconds == pytest.approx(total, rel=1e-12) and seconds > 0
    assert cost == pytest.approx(seconds * PRICE / 3600, rel=1e-9)
