"""A live worker is never booked dead: two real workers, one of which reaches PostgreSQL
through a TCP proxy that stalls (holds every byte, both ways) for 1.2 leases, three times
during one job. The stalled worker gives each run up before its lease runs out, the other
takes the chunk over and releases the items in flight: the job completes with nothing
lost, duplicated or failed, and no item charged an attempt or a crash (no worker died).

Real Redis, PostgreSQL and `specq worker` subprocesses; leases of 6 s and a reconciler
every second keep it to about half a minute (the production defaults are 30 s and 15 s).
"""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.engine import make_url

from specq.api.client import Client
from specq.bench.proxy import Proxy
from specq.db.models import Chunk, Item, ItemStatus, JobStatus
from tests.conftest import wait_until
from tests.pipeline.conftest import own_deployment

PAIR, LEASE, STALLS = "tiny-lookup", 6.0, 3
ITEMS = 1200  # enough work that three stalls land inside the job on a quiet machine too


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
        job = client.submit([f"stall {i}: rewrite the quick brown fox jumps over the lazy dog"
                             for i in range(ITEMS)], pair=PAIR, max_new_tokens=16, chunk_size=8)

        def stalled_holds_a_lease() -> str | None:
            with client.sessions() as s:
                return s.scalar(select(Chunk.lease_owner).where(
                    Chunk.job_id == job.id, Chunk.lease_owner.like(f"{stalled.name}@%")))

        held: list[str] = []
        for n in range(STALLS):
            # a run of the stalled worker's that the stall will strike (not one struck before)
            held.append(wait_until(lambda: (o := stalled_holds_a_lease()) not in held and o,
                                   120, f"stall {n + 1}: the worker holds no lease"))
            proxy.stall()
            time.sleep(1.2 * LEASE)
            proxy.restore()
            assert job.status(check_workers=False).pending > 0, "the job ended: too short"
        state = job.wait(progress=False, timeout=900)
        log = stalled.log.read_text()
        assert state.status == JobStatus.completed.value, "".join(w.output() for w in workers)
        with client.sessions() as s:
            rows = s.execute(select(Item.index, Item.status, Item.writes, Item.attempts,
                                    Item.crashes).where(Item.job_id == job.id)).all()
        lost = [r.index for r in rows if r.status == ItemStatus.pending.value]
        failed = [r.index for r in rows if r.status == ItemStatus.failed.value]
        twice = [r.index for r in rows if r.writes != 1]
        charged = [(r.index, r.attempts, r.crashes) for r in rows if r.attempts or r.crashes]
        assert (len(rows), lost, failed, twice, charged) == (ITEMS, [], [], [], []), \
            "".join(w.output() for w in workers)
        assert all(w.proc.poll() is None for w in workers)  # no worker died
        given_up = log.count("the run gives the chunk up")
        released = steady.log.read_text().count("released, not charged")
        assert given_up >= 1, stalled.output()  # the stalls struck runs, which gave up
        print(f"\n{STALLS} stalls of {1.2 * LEASE:.1f} s: {given_up} runs given up, {released}"
              f" takeovers released their items; {ITEMS} items: 0 lost, 0 duplicated, 0 failed,"
              f" 0 charged")
    finally:
        proxy.close()
