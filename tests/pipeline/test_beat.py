"""Beat schedules: a firing starts a run; a firing while that run is unfinished starts none,
whether the firings race each other (threads through the real Redis lock) or come from a
real `specq beat` (Celery beat) subprocess firing every second. The spec's pair, tiny-lookup,
has no worker in this session, so its run stays queued until the test cancels it."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import yaml

from specq.api.beat import beat_schedule, fire
from specq.api.client import Client
from specq.db import repository as repo
from specq.db.models import Job
from tests.pipeline.conftest import ROOT, worker_env


@pytest.fixture
def beat_settings(settings, tmp_path):
    spec = {"name": "beat-spec", "pair": "tiny-lookup", "seed_data": "seeds.csv",
            "template": "Say {{ word }}", "n": 2, "sampling": {"max_new_tokens": 4},
            "output": {"path": str(tmp_path / "beat-{job_id}.jsonl")}}
    (tmp_path / "synth").mkdir()
    (tmp_path / "synth" / "seeds.csv").write_text("word\napple\npear\n")
    (tmp_path / "synth" / "beat.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "schedules.yaml").write_text(yaml.safe_dump({
        "threads": {"spec": "synth/beat.yaml", "every": 1},
        "beat-e2e": {"spec": "synth/beat.yaml", "every": 1},
        "nightly": {"spec": "synth/beat.yaml", "cron": "0 3 * * *"},
    }))
    return settings.model_copy(update={"schedules_file": tmp_path / "schedules.yaml"})


def runs(client: Client, schedule: str) -> list:
    with client.sessions() as s:
        return [repo.get_job(s, job_id=j) for j in repo.latest_job_ids(s, schedule=schedule)]


def test_beat_schedule_from_yaml(beat_settings):
    entries = beat_schedule(beat_settings)
    assert entries["schedule:threads"]["schedule"] == 1.0
    assert str(entries["schedule:nightly"]["schedule"]).startswith("<crontab: 0 3 * * *")
    assert entries["schedule:nightly"]["args"] == ["nightly"]
    assert entries["collect"]["options"]["queue"] == f"{beat_settings.queue_prefix}.synth"


def test_concurrent_firings_start_one_run(beat_settings):
    client = Client(beat_settings)
    with ThreadPoolExecutor(4) as pool:
        ids = list(pool.map(lambda _: fire("threads", beat_settings), range(4)))
    started = [i for i in ids if i is not None]
    assert len(started) == 1, ids
    assert fire("threads", beat_settings) is None  # the run is still queued
    (job,) = runs(client, "threads")
    assert job.id == started[0] and job.spec == "beat-spec" and job.total == 4
    assert [s.id for s in client.jobs(schedule="threads")] == [job.id]

    client.job(job.id).cancel()  # the run finished: the next slot starts a new one
    again = fire("threads", beat_settings)
    assert again is not None and again != job.id
    client.job(again).cancel()


def test_celery_beat_fires_once_while_run_going(beat_settings, tmp_path):
    client = Client(beat_settings)
    env = worker_env(beat_settings)
    env["SPECQ_SCHEDULES_FILE"] = str(beat_settings.schedules_file)
    log = tmp_path / "beat.log"
    proc = subprocess.Popen([sys.executable, "-m", "specq.api.cli", "beat"], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and log.read_text().count("slot skipped") < 3:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        text = log.read_text()
        assert text.count("slot skipped") >= 3, text[-3000:]
        (job,) = runs(client, "beat-e2e")  # many firings, one run
        assert job.status == "queued" and job.schedule == "beat-e2e"
    finally:
        proc.terminate()
        proc.wait(30)
        for name in ("beat-e2e", "threads", "nightly"):
            for j in runs(client, name):
                client.job(j.id).cancel()


def test_a_stuck_run_is_said_and_replaced_not_skipped_forever(beat_settings, caplog):
    """A run with no worker never finishes: past stuck_after each firing says so, and
    cancels it for a new run (on_stuck: cancel) or skips on (on_stuck: skip)."""
    (beat_settings.schedules_file.parent / "stuck.yaml").write_text(yaml.safe_dump({
        "stuck": {"spec": "synth/beat.yaml", "every": 60, "stuck_after": 600},
        "stuck-skip": {"spec": "synth/beat.yaml", "every": 60, "stuck_after": 600,
                       "on_stuck": "skip"},
    }))
    beat_settings = beat_settings.model_copy(update={
        "schedules_file": beat_settings.schedules_file.parent / "stuck.yaml"})
    client = Client(beat_settings)

    def age(job_id: int) -> None:  # its run stored 601 s ago: no clock in the test
        with client.sessions.begin() as s:
            job = s.get(Job, job_id)
            job.created_at = job.created_at - timedelta(seconds=601)

    first = fire("stuck", beat_settings)
    assert first is not None and fire("stuck", beat_settings) is None  # young: skipped
    age(first)
    with caplog.at_level("ERROR", logger="specq.api.beat"):
        second = fire("stuck", beat_settings)
    assert second not in (None, first)
    assert client.job(first).status(check_workers=False).status == "cancelled"
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"run {first} is stuck: queued" in said and "no worker is consuming" in said

    kept = fire("stuck-skip", beat_settings)
    age(kept)
    caplog.clear()
    with caplog.at_level("ERROR", logger="specq.api.beat"):
        assert fire("stuck-skip", beat_settings) is None
    assert f"run {kept} is stuck" in caplog.text and "on_stuck: skip" in caplog.text
    for j in (second, kept):
        client.job(j).cancel()
