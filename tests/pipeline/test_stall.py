"""A live worker is never booked dead: two real workers, one of which reaches PostgreSQL
through a TCP proxy that stalls (holds every byte, both ways) for 1.2 leases, three times
while it holds a lease. The stalled worker gives each run up before its lease runs out, the
other takes the chunk over and releases the items in flight: every job completes with
nothing lost, duplicated or failed, and no item charged an attempt or a crash (no worker
died). Work is topped up with another job whenever the last one has nothing pending, so a
fast machine that ends a job early cannot leave a stall with nothing to strike.

Real Redis, PostgreSQL and `specq worker` subprocesses; leases of 6 s and a reconciler
every second keep it to about half a minute (the production defaults are 30 s and 15 s).
"""

from __future__ import annotations

import time

from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from specq.api.client import Client
from specq.bench.proxy import Proxy
from specq.db.models import Chunk, Item, ItemStatus, JobStatus
from tests.conftest import wait_until
from tests.pipeline.conftest import own_deployment

PAIR, LEASE, STALLS = "tiny-lookup", 6.0, 3
ITEMS = 400  # per job; another is submitted whenever the work runs out before a stall


def test_a_worker_whose_database_stalls_three_times_is_never_booked_dead(settings,
                                                                        start_worker):
    own = own_deployment(settings, "stall", visibility_timeout=3600, lease_seconds=LEASE,
                         db_timeout=2.0, reconcile_every=1.0, reconcile_grace=1.0,
                         retry_backoff=0.2, retry_backoff_max=1.0, flush_every=0.3,
                         max_attempts=2)
    proxy = Proxy("127.0.0.1", 5432).start()
    via = own.model_copy(update={"database_url": make_url(own.database_url)
                                 .set(port=proxy.port).render_as_string(hide_password=False)})
    client = Client(own)
    try:
        stalled = start_worker(via, PAIR, "stalled", ready=own)
        steady = start_worker(own, PAIR, "steady")
        workers = (stalled, steady)
        jobs: list = []

        def submit() -> None:
            jobs.append(client.submit(
                [f"stall {len(jobs)}.{i}: rewrite the quick brown fox jumps over the lazy dog"
                 for i in range(ITEMS)], pair=PAIR, max_new_tokens=16, chunk_size=8))

        def ours() -> list[int]:
            return [j.id for j in jobs]

        def stalled_holds_a_lease() -> str | None:
            with client.sessions() as s:
                owner = s.scalar(select(Chunk.lease_owner).where(
                    Chunk.job_id.in_(ours()), Chunk.lease_owner.like(f"{stalled.name}@%")))
            if owner is None and all(j.status(check_workers=False).pending == 0 for j in jobs):
                submit()  # the work ran out before this stall: more, never a lost stall
            return owner

        def holds(owner: str) -> bool:  # read past the proxy, on the direct connection
            with client.sessions() as s:
                return bool(s.scalar(select(func.count()).select_from(Chunk).where(
                    Chunk.lease_owner == owner)))

        submit()
        held: list[str] = []
        while len(held) < STALLS:
            # a run of the stalled worker's that the stall will strike (not one struck before)
            owner = wait_until(lambda: (o := stalled_holds_a_lease()) not in held and o, 300,
                               f"stall {len(held) + 1}: the worker holds no lease")
            proxy.stall()
            if not holds(owner):  # the run ended just before the stall: strike the next one
                proxy.restore()
                continue
            held.append(owner)  # it cannot write while stalled, so it holds it till given up
            time.sleep(1.2 * LEASE)
            proxy.restore()
        states = [j.wait(progress=False, timeout=900) for j in jobs]
        log = stalled.log.read_text()
        assert {s.status for s in states} == {JobStatus.completed.value}, \
            "".join(w.output() for w in workers)
        with client.sessions() as s:
            rows = s.execute(select(Item.index, Item.status, Item.writes, Item.attempts,
                                    Item.crashes).where(Item.job_id.in_(ours()))).all()
        lost = [r.index for r in rows if r.status == ItemStatus.pending.value]
        failed = [r.index for r in rows if r.status == ItemStatus.failed.value]
        twice = [r.index for r in rows if r.writes != 1]
        charged = [(r.index, r.attempts, r.crashes) for r in rows if r.attempts or r.crashes]
        assert (len(rows), lost, failed, twice, charged) == (ITEMS * len(jobs), [], [], [], []), \
            "".join(w.output() for w in workers)
        assert all(w.proc.poll() is None for w in workers)  # no worker died
        given_up = log.count("the run gives the chunk up")
        released = steady.log.read_text().count("released, not charged")
        assert given_up >= STALLS, stalled.output()  # each stall struck a run, which gave up
        print(f"\n{STALLS} stalls of {1.2 * LEASE:.1f} s: {given_up} runs given up, {released}"
              f" takeovers released their items; {len(rows)} items in {len(jobs)} jobs:"
              " 0 lost, 0 duplicated, 0 failed, 0 charged")
    finally:
        proxy.close()
