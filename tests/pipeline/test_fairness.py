"""Jobs on one queue share its workers: a job submitted behind a long one starts within a
few chunks (each job keeps only SPECQ_DISPATCH_WINDOW messages on the broker, and each
chunk a worker starts sends its job's next); a high-priority job goes before the waiting
chunks of normal ones, a low-priority one after them.

Timing-free: the order in which chunks took their first lease (chunks.leased_at, the
database's clock) is what is checked. The worker's engine is a stand-in that answers at
once (bench/standin.py): the test is about dispatch, not generation.
"""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from specq.api.client import Client
from specq.db.clock import db_now
from specq.db.models import Chunk
from tests.pipeline.conftest import own_deployment

PAIR = "tiny-lookup"
WINDOW = 2


@pytest.fixture(scope="module")
def own(settings, start_worker):
    """Settings with a queue of their own and one stand-in worker on it."""
    mine = own_deployment(settings, "fair", dispatch_window=WINDOW)
    start_worker(mine, PAIR, "fair", standin=True)
    return mine, Client(mine)


def _submit(client: Client, n: int, tag: str, **kw):
    return client.submit([f"{tag} {i}" for i in range(n)], pair=PAIR, chunk_size=2,
                         max_new_tokens=1, **kw)


def _leases(client: Client, job_id: int) -> list[float]:
    with client.sessions() as s:
        return sorted(s.scalars(select(Chunk.leased_at).where(
            Chunk.job_id == job_id, Chunk.leased_at.is_not(None))))


def _now(client: Client) -> float:
    with client.sessions() as s:
        return s.scalar(select(db_now()))


def _started(client: Client, job, chunks: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(_leases(client, job.id)) < chunks:
        assert time.monotonic() < deadline, f"job {job.id} did not start"
        time.sleep(0.1)


def test_a_small_job_behind_a_long_one_starts_within_its_window(own):
    _, client = own
    big = _submit(client, 400, "big")  # 200 chunks
    _started(client, big, 3)
    small = _submit(client, 4, "small")  # 2 chunks
    # once submit returns, its messages are on the broker; the worker may have taken many
    # big chunks while it stored and sent them (its first send opens a connection)
    at = _now(client)
    assert small.wait(progress=False, timeout=120).status == "completed"
    assert big.wait(progress=False, timeout=300).status == "completed"
    small_last = max(_leases(client, small.id))
    big_leases = _leases(client, big.id)
    between = [t for t in big_leases if at < t < small_last]
    # the big job's messages already waiting when the small one came (its window), and one
    # more if the reconciler topped the window up as a worker took one
    assert len(between) <= WINDOW + 1, (len(between), len(big_leases))
    assert sum(t > small_last for t in big_leases) >= 60  # it really was behind


def test_priorities_go_before_and_after_normal_jobs(own):
    _, client = own
    big = _submit(client, 400, "normal")
    _started(client, big, 3)
    low = _submit(client, 4, "low", priority="low")
    high = _submit(client, 4, "high", priority="high")
    at = _now(client)  # its messages are on the broker (see above)
    for job in (big, low, high):
        assert job.wait(progress=False, timeout=300).status == "completed"
    big_leases, high_leases = _leases(client, big.id), _leases(client, high.id)
    # the high job's two chunks go before every normal chunk still waiting (one may have
    # been taken as it was submitted)
    assert len([t for t in big_leases if at < t < max(high_leases)]) <= 1
    # the low job's go after every normal chunk
    assert min(_leases(client, low.id)) > max(big_leases)
