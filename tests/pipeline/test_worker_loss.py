"""A worker killed with SIGKILL mid-job: another finishes it; nothing lost, nothing twice."""

from __future__ import annotations

import time
from collections import Counter

from sqlalchemy import select

from api.client import Client
from db.models import Item, ItemStatus, JobStatus


def test_kill_9_mid_job_then_another_worker_completes_it(settings, start_worker):
    # Queues of their own, so that the session's other worker takes no chunk of this job.
    own = settings.model_copy(update={"queue_prefix": settings.queue_prefix + "-kill",
                                      "visibility_timeout": 20})
    client = Client(own)
    first = start_worker(own, "tiny", "doomed")
    job = client.submit([f"Correct sentence {i}: he go to school" for i in range(300)],
                        pair="tiny", max_new_tokens=16, chunk_size=10)
    deadline = time.monotonic() + 120
    while job.status(check_workers=False).completed < 40:
        assert time.monotonic() < deadline, first.output()
        time.sleep(0.05)
    first.kill()
    done_by_first = job.status(check_workers=False).completed
    assert done_by_first < 300

    second = start_worker(own, "tiny", "rescuer")
    state = job.wait(progress=False, timeout=240)
    assert state.status == JobStatus.completed.value, first.output() + second.output()
    assert (state.completed, state.pending, state.failed) == (300, 0, 0)
    with client.sessions() as s:
        rows = s.execute(select(Item.index, Item.status, Item.writes, Item.worker, Item.output)
                         .where(Item.job_id == job.id).order_by(Item.index)).all()
    assert [r.index for r in rows] == list(range(300))
    assert all(r.status == ItemStatus.completed.value and r.output is not None for r in rows)
    assert all(r.writes == 1 for r in rows), "an item was written twice"
    by_worker = Counter(r.worker.split("@")[0] for r in rows)
    assert by_worker[first.name] == done_by_first  # what the first wrote stayed as it was
    assert by_worker[second.name] == 300 - done_by_first
