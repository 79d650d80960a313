"""db/glance.py: `specq status JOB` read with the driver alone says what the client says, or
steps aside (None) for the client's path. On SQLite and the real PostgreSQL server; the
command itself in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from specq.api.client import RUNNABLE, Client
from specq.configs.settings import Settings
from specq.db import chunks, glance
from specq.db import repository as repo
from specq.db.models import ItemStatus, Job, JobStatus
from specq.db.outcomes import Outcome
from specq.db.session import migrate
from specq.schema.counters import Counters
from tests.db.conftest import queued_job


@pytest.fixture(params=["sqlite", "postgresql"])
def client(request, monkeypatch, tmp_path):
    url = (f"sqlite:///{tmp_path / 'specq.db'}" if request.param == "sqlite"
           else request.getfixturevalue("pg_url"))
    migrate(url)
    monkeypatch.setenv("SPECQ_DATABASE_URL", url)
    monkeypatch.chdir(tmp_path)  # no .env file here
    # a broker nobody listens on: the client's own path must not hang on it
    return Client(Settings(database_url=url, data_dir=tmp_path,
                           broker_url="redis://127.0.0.1:1/0", broker_timeout=1))


def _job(client, n=10, chunk_size=4) -> int:
    return queued_job(client.sessions, n=n, chunk_size=chunk_size)


def _outcome(i: int, status: ItemStatus) -> Outcome:
    ok = status == ItemStatus.completed
    return Outcome(i, status, output="o" if ok else None, token_ids=[1] if ok else [],
                   finish_reason="length" if ok else None, prompt_tokens=1,
                   counters=Counters(), worker="w", error=None if ok else "too long")


def _client_says(client, job_id: int, check_workers: bool = True) -> dict:
    return client.job(job_id).status(check_workers=check_workers).as_dict()


def test_a_finished_job_reads_as_the_client_reads_it(client):
    job_id = _job(client)
    with client.sessions.begin() as s:
        repo.write_outcomes(s, job_id=job_id, outcomes=[_outcome(i, ItemStatus.completed)
                                                         for i in range(7)])
        repo.write_outcomes(s, job_id=job_id, outcomes=[_outcome(i, ItemStatus.failed)
                                                         for i in range(7, 10)])
        chunks.add_fault(s, job_id=job_id, start=4, error="worker died: killed")
        chunks.add_fault(s, job_id=job_id, start=0, error="engine: out of memory")
        repo.settle_job(s, job_id=job_id)
    said = glance.job_state(job_id)
    assert said is not None and said["status"] == JobStatus.completed.value
    assert said == _client_says(client, job_id)
    assert (said["completed"], said["failed"], said["engine_faults"]) == (7, 3, 2)
    # the earliest (on SQLite's millisecond clock, a tie: the first chunk), as the client picks
    assert said["first_fault"] in ("worker died: killed", "engine: out of memory")
    assert glance.status_text(job_id) == json.dumps(_client_says(client, job_id), indent=2)


def test_a_running_job_is_read_here_while_a_worker_holds_a_lease_on_it(client):
    job_id = _job(client)
    assert glance.job_state(job_id) is None  # queued, no lease: is any worker up? the broker's
    with client.sessions.begin() as s:
        assert chunks.claim(s, job_id=job_id, start=4, owner="w1", ttl=60) == 1
        repo.set_job_status(s, job_id=job_id, status=JobStatus.in_progress)
        repo.write_outcomes(s, job_id=job_id, outcomes=[_outcome(4, ItemStatus.completed)])
    said = glance.job_state(job_id)
    assert said is not None and (said["pending"], said["completed"]) == (9, 1)
    # the live lease stands for the worker the client asks the broker about (none here:
    # the client's note would say so; a worker holding a lease is serving the job)
    assert said == _client_says(client, job_id, check_workers=False)


def test_what_it_cannot_say_exactly_goes_the_clients_way(client, monkeypatch, tmp_path):
    job_id = _job(client)
    with client.sessions.begin() as s:
        chunks.claim(s, job_id=job_id, start=0, owner="w1", ttl=60)
        s.get(Job, job_id).error = "a chunk failed on a worker"  # its note names a setting
    assert glance.job_state(job_id) is None
    assert glance.job_state(10**9) is None  # not found: the client words the error
    with client.sessions.begin() as s:  # stored by hand, no chunks
        bare = repo.create_job(s, pair="tiny", params={}, chunk_size=4, source=None)
        bare.status = JobStatus.completed.value
    assert glance.job_state(bare.id) is None
    for elsewhere in ("postgresql+psycopg://postgres@127.0.0.1:1/test",  # nothing there
                      f"sqlite:///{tmp_path / 'none.db'}"):  # no such file: none made
        monkeypatch.setenv("SPECQ_DATABASE_URL", elsewhere)
        assert glance.job_state(job_id) is None
    assert not (tmp_path / "none.db").exists()


@pytest.mark.parametrize("seed", range(6))
def test_random_jobs_read_here_as_the_client_reads_them_or_not_at_all(client, seed):
    """Random sizes, outcomes, faults, leases and statuses: where the fast read answers it
    says what the client says (a running job with items pending only under a live lease)."""
    rng = random.Random(seed)
    answered = 0
    for _ in range(8):
        n, size = rng.randint(1, 12), rng.randint(1, 5)
        job_id = _job(client, n=n, chunk_size=size)
        with client.sessions.begin() as s:
            done = rng.sample(range(n), rng.randint(0, n))
            repo.write_outcomes(s, job_id=job_id, outcomes=[
                _outcome(i, rng.choice([ItemStatus.completed, ItemStatus.failed]))
                for i in done])
            for start in rng.sample(range(0, n, size), rng.randint(0, 2) if n > size else 0):
                chunks.add_fault(s, job_id=job_id, start=start, error=f"fault at {start}")
            leased = rng.random() < 0.5
            if leased:
                chunks.claim(s, job_id=job_id, start=0, owner="w", ttl=60)
            repo.set_job_status(s, job_id=job_id, status=rng.choice(list(JobStatus)))
            if rng.random() < 0.2:
                s.get(Job, job_id).error = "a chunk failed on a worker"
        said = glance.job_state(job_id)
        if said is None:
            continue
        answered += 1
        assert said == _client_says(client, job_id, check_workers=False)
        if said["status"] in glance.RUNNABLE and said["pending"]:
            assert leased
        else:
            assert said == _client_says(client, job_id)
    assert answered, "no job was read here: the test shows nothing"


def test_its_status_sets_are_the_clients():
    assert set(glance.RUNNABLE) == set(RUNNABLE)
    assert set(glance.FINISHED) == {s.value for s in JobStatus if s.finished}


def test_the_database_is_the_one_the_settings_would_pick(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {"SPECQ_DATABASE_URL": "postgres://u:p%40ss@h:5433/db"}
    assert glance.database(env) == ("postgresql", "postgresql://u:p%40ss@h:5433/db")
    env = {"SPECQ_DATABASE_URL": "postgresql+psycopg://u@h/db"}
    assert glance.database(env) == ("postgresql", "postgresql://u@h/db")
    for url in ("specq.db", "/abs/specq.db"):
        env = {"SPECQ_DATABASE_URL": f"sqlite:///{url}"}
        assert glance.database(env) == ("sqlite", str(Settings(**{
            "database_url": f"sqlite:///{url}"}).sqlalchemy_url).removeprefix("sqlite:///"))
    env = {"SPECQ_DATA_DIR": "data"}  # no URL: the embedded file in the data directory
    assert glance.database(env) == ("sqlite", str(tmp_path / "data" / "specq.db"))
    for other in ("postgresql://u@h/db", "postgresql+psycopg2://u@h/db", "sqlite://",
                  "sqlite:///f.db?mode=ro", "mysql://u@h/db"):
        assert glance.database({"SPECQ_DATABASE_URL": other}) is None
    (tmp_path / ".env").write_text("SPECQ_DATABASE_URL=postgresql+psycopg://u@h/db\n")
    assert glance.database({}) is None  # a .env file may name another database
    assert glance.database({"SPECQ_DATABASE_URL": "sqlite:///f.db"}) is not None


def _specq(*argv: str, code: str = "") -> subprocess.CompletedProcess:
    """`specq ARGV` as a user runs it (python -m specq), or ``code`` after main(ARGV)."""
    run = ["-m", "specq", *argv] if not code else [
        "-c", f"import sys\nfrom specq.api.command import main\nmain({list(argv)!r})\n{code}"]
    return subprocess.run([sys.executable, *run], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SPECQ_BROKER_URL": "redis://127.0.0.1:1/0",
                               "SPECQ_BROKER_TIMEOUT": "1"})


def test_the_command_answers_without_sqlalchemy_and_falls_back_with_its_errors(client):
    job_id = _job(client, n=4)
    with client.sessions.begin() as s:
        repo.write_outcomes(s, job_id=job_id, outcomes=[_outcome(i, ItemStatus.completed)
                                                         for i in range(4)])
        repo.settle_job(s, job_id=job_id)
    out = _specq("status", str(job_id),
                 code="print(sorted(m for m in ('sqlalchemy', 'pydantic_settings') "
                      "if m in sys.modules), file=sys.stderr)")
    assert out.returncode == 0 and out.stderr.strip() == "[]", out.stderr
    assert json.loads(out.stdout) == _client_says(client, job_id)
    # every other form is cli.py's, with its answers and errors
    watched = _specq("status", str(job_id), "--watch")
    assert watched.returncode == 0 and "completed" in watched.stdout
    missing = _specq("status", "999999")
    assert missing.returncode == 1 and "job 999999: not found" in missing.stderr
    bad = _specq("status", "x")
    assert bad.returncode == 2 and "status" in bad.stderr
