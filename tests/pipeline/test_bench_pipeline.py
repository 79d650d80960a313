"""`specq bench-pipeline` runs on the tiny pair against the real Redis and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys


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
    for key in ("engine_alone_s", "job_path_s", "overhead_ratio", "submission_prompts_per_s",
                "result_rows_written_per_s"):
        assert report[key] > 0, key
    assert "ratio" in done.stdout
