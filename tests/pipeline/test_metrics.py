"""What `specq metrics` and `specq report` show, derived from the stored item counters."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specq.api.client import JobMetrics
from specq.api.report import draw_report, format_metrics
from specq.configs.presets import get_preset
from specq.worker.pairs import load_pair
from specq.worker.tasks import run_inline


@pytest.fixture(scope="module")
def finished_job(client, settings):
    engine = load_pair(get_preset("tiny-fixed"), settings).engine(max_batch_size=4)
    job = client.submit([f"Rewrite: item {i} is here" for i in range(12)], pair="tiny-fixed",
                        enqueue=False, max_new_tokens=12, chunk_size=5)
    run_inline(sessions=client.sessions, engine=engine, pair="tiny-fixed", job_id=job.id,
               progress=False)
    return job


def test_metrics_are_sums_of_item_counters(finished_job):
    m = finished_job.metrics()
    items = list(finished_job.results())
    by_g = [0] * max(len(it.counters["steps_by_draft_length"] or []) for it in items)
    for it in items:
        for g, n in enumerate(it.counters["steps_by_draft_length"] or []):
            by_g[g] += n
    assert m.steps_by_draft_length == by_g and sum(by_g) > 0
    assert sum(by_g) == m.target_passes - m.completed  # every pass but each item's prefill
    assert m.accepted == sum(it.counters["accepted"] for it in items)
    assert 1 <= len(m.draft_length_over_time) <= 10
    text = format_metrics(m)
    for needle in ("acceptance rate", "mean acceptance length", "accepted by position",
                   "steps by draft length", "g over time", "tokens/s", "worker-seconds",
                   "target passes saved", "device time saved", "estimated cost"):
        assert needle in text
    # the embedded run holds its chunks too: charged, though priced by no one
    assert m.worker_seconds > 0 and m.estimated_cost is None
    assert m.prompt_tokens == sum(it.prompt_tokens for it in items) > 0
    assert m.passes_saved == m.new_tokens - m.target_passes


def test_derived_figures_from_known_counters():
    """Each rate against numbers worked out by hand, not against its own formula."""
    m = JobMetrics(job_id=1, status="completed", total=4, completed=4, failed=0, cancelled=0,
                   pending=0, wall_time=8.0, draft_steps=6, proposed=12, accepted=9,
                   accepted_by_position=[5, 3, 1], target_passes=16, new_tokens=40,
                   steps_by_draft_length=[2, 0, 6], draft_time=1.0, verify_time=3.0)
    assert m.acceptance_rate == 0.75  # 9 of 12 proposed
    assert m.mean_acceptance_length == 2.5  # 1 + 9 accepted / 6 draft steps
    assert m.acceptance_by_position == [5 / 6, 3 / 6, 1 / 6]
    assert m.mean_draft_length == 1.5  # (2 x 0 + 6 x 2) / 8 steps
    assert m.tokens_per_second == 5.0  # 40 tokens / 8 s
    assert m.engine_tokens_per_second == 10.0  # 40 / (1 + 3) s
    assert m.estimated_speedup == 1.875  # 40 / 16 tokens per pass x 3 / 4 verify share
    nothing = JobMetrics(job_id=2, status="queued", total=1, completed=0, failed=0,
                         cancelled=0, pending=1, wall_time=None)
    assert (nothing.acceptance_rate, nothing.mean_acceptance_length, nothing.mean_draft_length,
            nothing.tokens_per_second, nothing.estimated_speedup) == (None,) * 5
    assert nothing.acceptance_by_position == []


def test_throughput_over_time_adds_up_to_the_tokens(finished_job):
    """Each interval's tokens/s x its width, summed, is every token generated; the job's
    pair and drafting come with its metrics (the report's title)."""
    m = finished_job.metrics()
    points = m.throughput_over_time
    # 12 items in 3 chunks: fewer than 10 chunks, so at the grain of items, one interval
    # per item at most
    assert 1 <= len(points) <= 12
    width = 2 * points[0][0]
    assert sum(rate * width for _, rate in points) == pytest.approx(m.new_tokens)
    assert (m.pair, m.drafter) == ("tiny-fixed", "model") and m.draft_length


def test_report_png_and_cli(finished_job, settings, env_for, tmp_path):
    png = draw_report(finished_job.metrics(), tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    env = env_for(settings)
    cli = [sys.executable, "-m", "specq.api.cli"]
    out = subprocess.run(cli + ["metrics", str(finished_job.id)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "acceptance rate" in out.stdout and f"job {finished_job.id}" in out.stdout
    out = subprocess.run(cli + ["report", str(finished_job.id), "-o", str(tmp_path / "c.png")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "c.png").stat().st_size > 1000
