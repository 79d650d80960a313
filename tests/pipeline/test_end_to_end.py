"""Python client → Redis → a real Celery worker (subprocess) → PostgreSQL, and back."""

from __future__ import annotations

import logging
import time

import pytest
from sqlalchemy import select

from specq.db.models import Item, ItemStatus, JobStatus
from specq.schema.counters import SCALARS

GRAMMAR_COUNTERS = {"forced_proposed", "forced_accepted", "mask_time"}
log = logging.getLogger(__name__)


def test_500_prompts_each_get_one_output_and_metrics_sum_up(client, tiny_fixed_worker):
    prompts = [f"Rewrite sentence {i}: the quick brown fox jumps over the dog" for i in range(500)]
    t0 = time.perf_counter()
    # the pair drafts at a fixed g (the adaptive engine may rightly never draft with the
    # tiny pair, whose draft costs as much as its target): counters to sum up
    job = client.submit(prompts, pair="tiny-fixed", max_new_tokens=12, chunk_size=25,
                        temperature=0.8, seed=7)
    state = job.wait(progress=False, timeout=300)
    wall = time.perf_counter() - t0
    log.warning("500 prompts end to end in %.1f s", wall)
    assert state.status == JobStatus.completed.value, tiny_fixed_worker.output()
    assert (state.total, state.completed, state.pending) == (500, 500, 0)

    items = list(job.results())
    assert [it.index for it in items] == list(range(500))
    assert all(it.status == ItemStatus.completed.value and it.output is not None for it in items)
    assert all(it.finish_reason in ("stop", "length") for it in items)
    with client.sessions() as s:
        writes = s.scalars(select(Item.writes).where(Item.job_id == job.id)).all()
    assert writes == [1] * 500

    m = job.metrics()
    for name in SCALARS:  # int counters exactly, the seconds up to float summation order
        total = sum(it.counters[name] for it in items)
        assert getattr(m, name) == pytest.approx(total, rel=1e-9, abs=1e-9), name
        # a grammar's counters stay 0 without a response_format; every other one counted
        assert total == 0 if name in GRAMMAR_COUNTERS else total > 0, name
    by_pos = [0] * max(len(it.counters["accepted_by_position"]) for it in items)
    for it in items:
        for i, n in enumerate(it.counters["accepted_by_position"]):
            by_pos[i] += n
    assert m.accepted_by_position == by_pos
    assert m.proposed > 0 and m.acceptance_rate == m.accepted / m.proposed
    assert m.mean_acceptance_length == 1 + m.accepted / m.draft_steps
    assert m.completed == 500 and m.tokens_per_second > 0


def test_a_pair_no_worker_serves_stays_queued_and_says_so(client, tiny_worker):
    job = client.submit(["Correct: he go home"], pair="tiny-lookup", max_new_tokens=4)
    # a job sent after it, to a pair a worker serves, runs to its end: the broker was
    # delivering all along, and no worker took the first job's chunk
    later = client.submit(["Correct: she go home"], pair="tiny", max_new_tokens=4)
    assert later.wait(progress=False, timeout=120).status == JobStatus.completed.value
    state = job.status()
    assert state.status == JobStatus.queued.value and state.pending == 1
    assert "no worker is consuming queue" in state.note and "tiny-lookup" in state.note
    assert job.cancel().status == JobStatus.cancelled.value


def test_cancelling_a_running_job_stops_it_at_the_next_chunk(client, tiny_worker):
    chunk = 8
    job = client.submit([f"Summarise item {i}: a b c d e f" for i in range(240)], pair="tiny",
                        max_new_tokens=32, chunk_size=chunk)
    deadline = time.monotonic() + 120
    while job.status(check_workers=False).completed < 2 * chunk:
        assert time.monotonic() < deadline, tiny_worker.output()
        time.sleep(0.05)
    assert job.cancel().status in (JobStatus.cancelling.value, JobStatus.cancelled.value)
    state = job.wait(progress=False, timeout=120)
    assert state.status == JobStatus.cancelled.value
    assert state.pending == 0 and state.cancelled > 0 and state.completed >= 2 * chunk
    items = list(job.results())
    assert all(it.output is not None for it in items if it.status == "completed")
    # one worker takes chunks in order: the chunks before the cancel completed, the chunk
    # running at the cancel may be cut short, every later one is cancelled whole
    by_chunk = [{it.status for it in items[i:i + chunk]} for i in range(0, 240, chunk)]
    first_cut = next(k for k, s in enumerate(by_chunk) if s != {"completed"})
    assert all(s == {"completed"} for s in by_chunk[:first_cut])
    assert by_chunk[first_cut] <= {"completed", "cancelled"}
    assert all(s == {"cancelled"} for s in by_chunk[first_cut + 1:])


def test_a_workers_log_has_no_model_loading_progress_bars(client, tiny_fixed_worker):
    """Celery turns a worker's stderr into WARNING records: transformers' and the hub's
    progress bars are off in workers (worker/launch.py: WORKER_ENV), so none lands there."""
    job = client.submit(["Rewrite: the log stays quiet"], pair="tiny-fixed", max_new_tokens=4)
    assert job.wait(progress=False, timeout=120).status == JobStatus.completed.value
    text = tiny_fixed_worker.log.read_text()
    assert "Loading weights" not in text and "it/s]" not in text, text[-2000:]
