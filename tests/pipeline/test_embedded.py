"""`specq run`: the embedded default, SQLite and the task code in-process, no servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parents[2]


def test_specq_run_on_the_example_file(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    env["SPECQ_DATA_DIR"] = str(tmp_path / "data")
    out = tmp_path / "results.jsonl"
    example = ROOT / "examples" / "prompts.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "specq.api.cli", "run", str(example), "--pair", "tiny",
         "--output", str(out), "--chunk-size", "5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    expected = [json.loads(x)["custom_id"] for x in example.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == expected
    assert all(x["status"] == "completed" and x["output"] is not None for x in lines)
    # the table of `specq metrics` at the end; its JSON on request
    assert "acceptance" in proc.stdout and f"{len(expected)} completed" in " ".join(
        proc.stdout.split()), proc.stdout
    shown = subprocess.run([sys.executable, "-m", "specq.api.cli", "metrics", "1", "--json"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]
    metrics = json.loads(shown.stdout)
    assert metrics["completed"] == len(expected)
    # the tiny draft is as large as its target (c ~ 1): the calibrated engine may rightly
    # never draft; whatever it chose, the counters add up
    assert metrics["new_tokens"] > 0 and 0 <= metrics["accepted"] <= metrics["proposed"]
    if metrics["proposed"]:
        assert 0 <= metrics["acceptance_rate"] <= 1
    db = create_engine(f"sqlite:///{tmp_path / 'data' / 'specq.db'}")
    with db.connect() as conn:  # the results are kept in the database too
        assert conn.execute(text("SELECT status FROM jobs")).scalars().all() == ["completed"]
        assert conn.execute(text("SELECT count(*) FROM items WHERE output IS NOT NULL")
                            ).scalar() == len(expected)


def test_specq_run_writes_the_format_its_output_names_and_keeps_stdout_for_results(tmp_path):
    """`-o out.parquet` is Parquet (as `specq results` reads a name: one rule, output_format,
    for both); `-o -` gives stdout to the results alone, the metrics going to stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    env["SPECQ_DATA_DIR"] = str(tmp_path / "data")
    lines = "".join(json.dumps({"custom_id": f"c{i}", "prompt": f"say {i}"}) + "\n"
                    for i in range(3))

    def run(*flags: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "specq.api.cli", "run", "-", "--pair",
                               "tiny", "--max-new-tokens", "4", *flags], input=lines, cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    from specq.api.cli import output_format

    assert [output_format(p, None) for p in ("o.parquet", "O.PARQUET", "o.jsonl", "-")] == [
        "parquet", "parquet", "jsonl", "jsonl"]
    assert output_format("o.parquet", "openai") == "openai"
    piped = run("-o", "-", "--json")
    assert [json.loads(x)["custom_id"] for x in piped.stdout.splitlines()] == ["c0", "c1", "c2"]
    assert '"completed": 3' in piped.stderr
