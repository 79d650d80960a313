"""Synthesis end to end: a spec over a 50-row seed file, n=3, on the tiny pair, through the
real `specq synth run --wait` path, real Redis, PostgreSQL and a Celery worker subprocess."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest
import yaml

from specq.api import cli
from specq.api.synthesis import SAMPLE_COLUMNS, sample_seed
from specq.configs.settings import get_settings
from specq.db import repository as repo
from tests.pipeline.conftest import worker_env

COMPARED = ["topic", "level", "row_index", "sample_index", "seed", "custom_id", "prompt",
            "output", "finish_reason", "status"]


@pytest.fixture
def cli_settings(settings, monkeypatch):
    """`specq` in this process reads the test session's settings from the environment."""
    for key, value in worker_env(settings).items():
        if key.startswith("SPECQ_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("SPECQ_CHUNK_SIZE", "50")
    get_settings.cache_clear()
    yield get_settings()
    get_settings.cache_clear()


def write_spec(tmp_path, **over) -> str:
    seeds = tmp_path / "seeds.jsonl"
    with seeds.open("w") as f:
        for i in range(50):
            f.write(json.dumps({"topic": f"topic number {i}", "level": i % 4}) + "\n")
    spec = {"name": "e2e", "pair": "tiny-fixed", "seed_data": "seeds.jsonl",
            "template": "Tell me about {{ topic }} at level {{ level }}:", "n": 3,
            "sampling": {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.95}, "seed": 7,
            "output": {"path": str(tmp_path / "out" / "e2e-{job_id}.parquet")}, **over}
    path = tmp_path / "e2e.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def run_spec(spec: str, capsys) -> str:
    capsys.readouterr()
    assert cli.main(["synth", "run", spec, "--wait", "--timeout", "120"]) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_synth_run_twice_same_data(cli_settings, tiny_fixed_worker, client, tmp_path, capsys):
    spec = write_spec(tmp_path)
    first = run_spec(spec, capsys)
    second = run_spec(spec, capsys)
    assert first != second  # one file per run ({job_id})

    a, b = pq.read_table(first), pq.read_table(second)
    assert a.num_rows == b.num_rows == 150
    assert a.column_names == ["topic", "level", *SAMPLE_COLUMNS]
    rows = a.to_pylist()
    assert [(r["row_index"], r["sample_index"]) for r in rows] == [
        (r, k) for r in range(50) for k in range(3)]
    assert all(r["status"] == "completed" and r["output"] is not None for r in rows)
    assert all(r["seed"] == sample_seed(7, r["row_index"], r["sample_index"]) for r in rows)
    assert rows[4]["topic"] == "topic number 1" and rows[4]["level"] == 1
    assert rows[4]["prompt"] == "Tell me about topic number 1 at level 1:"
    assert all(r["new_tokens"] >= 1 and r["proposed"] is not None for r in rows)
    # Same spec, same seed → the same data set; temperature 0.9, so the seed did matter:
    assert a.select(COMPARED).to_pylist() == b.select(COMPARED).to_pylist()
    outputs = [(r["row_index"], r["output"]) for r in rows]
    assert len({o for o in outputs}) > 50, "samples of a row should differ"

    # Each run records its spec (no schedule: a run by hand) and where its data set went.
    with client.sessions() as s:
        jobs = [repo.get_job(s, job_id=j) for j in repo.latest_job_ids(s, limit=5)]
        jobs = [j for j in jobs if j.spec == "e2e"][:2]
    assert {j.output_path for j in jobs} == {first, second}
    assert all(j.schedule is None and j.synthesis["n"] == 3 for j in jobs)

    # `specq status --watch` on a finished job: one line with progress and acceptance.
    capsys.readouterr()
    assert cli.main(["status", str(jobs[0].id), "--watch"]) == 0
    line = capsys.readouterr().out.strip()
    assert "completed: 150 completed, 0 failed, 0 cancelled, 0 pending of 150" in line
    assert re.search(r"acceptance [01]\.\d{3} ", line)
