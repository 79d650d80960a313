"""`specq bench-pipeline` and `specq bench-fleet` run on the tiny pairs against the real Redis
and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.pipeline.conftest import own_deployment


def test_bench_pipeline_reports_overhead_and_rates(settings, env_for, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "specq.api.cli", "bench-pipeline", "--pair", "tiny",
           "--prompts", "12",
           "--max-new-tokens", "8", "--batch-size", "4", "--submit-prompts", "500",
           "--write-rows", "300", "--output-dir", str(out)]
    done = subprocess.run(cmd, env=env_for(settings), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "pipeline.json").read_text())
    assert report["job_status"] == "completed" and report["database"].startswith("postgresql")
    assert report["same_outputs"] == 12  # greedy: the worker reproduces the engine alone
    assert report["engine_faults"] == 0  # a run with a fault would fail
    for key in ("engine_alone_s", "job_path_s", "overhead_ratio", "submission_prompts_per_s",
                "result_rows_written_per_s"):
        assert report[key] > 0, key
    assert "ratio" in done.stdout


def test_bench_fleet_runs_a_job_through_workers_exactly_once(settings, env_for, tmp_path):
    """A small `specq bench-fleet`: two stand-in workers, a job behind which a small one
    is submitted; every item written once, and each figure the note quotes is there."""
    own = own_deployment(settings, "fleet")
    out = tmp_path / "fleet"
    cmd = [sys.executable, "-m", "specq.api.cli", "bench-fleet", "--items", "600",
           "--workers", "2", "--chunk-size", "50", "--small-items", "20", "--small-at", "0",
           "--output-dir", str(out)]
    done = subprocess.run(cmd, env=env_for(own), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    r = json.loads((out / "fleet.json").read_text())
    assert r["exactly_once"] == {"items": 600, "writes": 600, "written_twice": 0,
                                 "not_completed": 0, "engine_faults": 0, "first_fault": None,
                                 "items_isolated": 0}
    assert r["small_job"]["exactly_once"]["writes"] == 20
    assert r["small_job"]["completed_after_s"] > 0
    for key in ("submit_items_per_s", "end_to_end_items_per_s", "processing_items_per_s",
                "status_s", "metrics_s", "export_s", "cli_status_s", "cli_metrics_s"):
        assert r[key] > 0, key
    assert all(m > 0 for m in r["worker_peak_mb"]) and len(r["worker_peak_mb"]) == 2
    assert "exactly once: 600 items, 600 writes, 0 written twice" in done.stdout
