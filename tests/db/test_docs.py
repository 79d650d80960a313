"""docs/database.md stays true: it lists every column of every table and view, and its
worked queries run, from psql (the real psql, on PostgreSQL) and from pandas (on SQLite and
PostgreSQL), giving the figures of the Python metrics. So does the overview's query
("Querying the database")."""

from __future__ import annotations

import csv
import io
import math
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.engine import make_url

from specq.configs.schedules import load_schedules
from specq.configs.settings import Settings
from specq.db import views
from specq.db.session import get_engine
from tests.db.conftest import known_jobs, python_metrics

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "database.md").read_text()
KINDS = {"key", "input", "state", "time", "count", "counter", "derived"}
QUERIES = dict(re.findall(r"<!-- query: ([\w-]+) -->\n```sql\n(.*?)```", DOC, re.S))
(PANDAS,) = re.findall(r"<!-- pandas -->\n```python\n(.*?)```", DOC, re.S)
FRAMES = {"one-job": "one_job", "by-position": "by_position", "schedule-runs": "schedule_runs",
          "by-drafter": "by_drafter"}  # each query's DataFrame in the pandas example


def documented() -> dict[str, dict[str, str]]:
    """{table or view: {column: kind}} from the '### `name`' sections' tables."""
    out: dict[str, dict[str, str]] = {}
    for name, body in re.findall(r"^### `(\w+)`\n(.*?)(?=^#|\Z)", DOC, re.S | re.M):
        out[name] = dict(re.findall(r"^\| `(\w+)` \| (\w+) \|", body, re.M))
    return out


def test_every_table_view_and_column_is_documented(db_url):
    found = inspect(get_engine(db_url))
    names = set(found.get_table_names()) | set(views.VIEWS.tables)
    docs = documented()
    assert set(docs) == names
    for name in names:
        columns = [c["name"] for c in found.get_columns(name)]
        assert sorted(docs[name]) == sorted(columns), name
        assert set(docs[name].values()) <= KINDS, name
    for name in views.VIEWS.tables:  # the figures are marked derived, the sums counters
        for figure in views.FIGURES:
            if figure in docs[name]:
                assert docs[name][figure] == "derived", (name, figure)


def test_the_worked_queries_are_the_pandas_ones():
    """The psql text and the pandas text of each query are one query (psql's :'name' is
    SQLAlchemy's :name)."""
    pandas_sql = re.findall(r'(\w+) = pd\.read_sql\(sa\.text\("""(.*?)"""\)', PANDAS, re.S)
    assert set(QUERIES) == set(FRAMES) and [n for n, _ in pandas_sql] == list(FRAMES.values())

    def norm(sql: str) -> str:
        return " ".join(re.sub(r":'(\w+)'", r":\1", sql).split()).rstrip(";")

    for (query, frame), (name, sql) in zip(FRAMES.items(), pandas_sql, strict=True):
        assert frame == name and norm(QUERIES[query]) == norm(sql), query


def null(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def same(got, want, what: str) -> None:
    if want is None:
        assert null(got), f"{what}: {got!r}, expected NULL"
    else:
        assert not null(got) and float(got) == pytest.approx(want, rel=1e-9), what


def run_pandas(url: str, job_id: int, schedule: str) -> dict:
    """The pandas example as written, on this database."""
    pytest.importorskip("pandas")
    code = PANDAS
    engine_line = re.search(r'^engine = sa\.create_engine\("[^"]+"\)$', code, re.M)
    params_line = re.search(r"^job_id, schedule = 42, \"nightly\"$", code, re.M)
    assert engine_line and params_line, "the example's first lines changed: update this test"
    code = code.replace(engine_line.group(0), f"engine = sa.create_engine({url!r})")
    code = code.replace(params_line.group(0), f"job_id, schedule = {job_id}, {schedule!r}")
    namespace: dict = {}
    exec(compile(code, "docs/database.md", "exec"), namespace)  # noqa: S102 (our own docs)
    namespace["engine"].dispose()
    return {query: namespace[frame] for query, frame in FRAMES.items()}


@pytest.fixture
def schedule():
    return f"nightly-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def jobs(sessions, schedule):
    return known_jobs(sessions, schedule=schedule)


def test_the_worked_queries_from_pandas_give_the_python_figures(db_url, jobs, schedule):
    drafting = jobs["drafting"]
    frames = run_pandas(db_url, drafting.id, schedule)
    want = python_metrics(drafting)

    (row,) = frames["one-job"].to_dict("records")
    assert (row["job_id"], row["status"], row["pair"], row["drafter"], row["draft_mode"]) == (
        drafting.id, "completed", "tiny", "model", "adaptive")
    for column in ("completed", "failed", "cancelled", "pending", "new_tokens"):
        assert row[column] == getattr(want, column), column
    for column in ("wall_time", "acceptance_rate", "mean_acceptance_length", "mean_draft_length",
                   "tokens_per_second", "engine_tokens_per_second", "estimated_speedup"):
        same(row[column], getattr(want, column), column)

    positions = frames["by-position"]
    assert list(positions["draft_position"]) == [1, 2, 3]
    assert list(positions["accepted"]) == want.accepted_by_position
    for got, share in zip(positions["acceptance"], want.acceptance_by_position, strict=True):
        same(got, share, "acceptance")

    scheduled = [jobs[n] for n in ("cancelled", "failures", "no-drafting", "drafting")]
    runs = frames["schedule-runs"].to_dict("records")
    assert [r["job_id"] for r in runs] == [j.id for j in scheduled]  # newest first
    for r, job in zip(runs, scheduled, strict=True):
        m = python_metrics(job)
        assert (r["status"], r["completed"], r["failed"]) == (job.status.value, m.completed,
                                                               m.failed)
        for column in ("acceptance_rate", "mean_acceptance_length", "tokens_per_second",
                       "estimated_speedup"):
            same(r[column], getattr(m, column), f"{job.name}: {column}")

    groups = {(r["drafter"], None if null(r["draft_mode"]) else r["draft_mode"]): r
              for r in frames["by-drafter"].to_dict("records")}
    assert set(groups) == {("model", "adaptive"), ("prompt_lookup", "adaptive"), ("none", None)}
    model = [python_metrics(jobs[n]) for n in ("drafting", "cancelled")]
    assert groups["model", "adaptive"]["runs"] == 2
    same(groups["model", "adaptive"]["acceptance_rate"],
         sum(m.acceptance_rate for m in model) / 2, "mean acceptance of the model runs")
    same(groups["none", None]["acceptance_rate"], None, "no drafting: no acceptance")
    same(groups["prompt_lookup", "adaptive"]["mean_acceptance_length"],
         python_metrics(jobs["failures"]).mean_acceptance_length, "prompt lookup")


def psql(url: str, sql: str, **variables) -> list[dict[str, str]]:
    """``sql`` run by psql as a user runs it (-v NAME=VALUE), rows as CSV strings."""
    u = make_url(url)
    conninfo = f"postgresql://{u.username}@{u.host}:{u.port}/{u.database}"
    args = ["psql", conninfo, "-X", "-q", "--csv", "-v", "ON_ERROR_STOP=1"]
    for name, value in variables.items():
        args += ["-v", f"{name}={value}"]
    done = subprocess.run(args, input=sql, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return list(csv.DictReader(io.StringIO(done.stdout)))


@pytest.mark.skipif(not shutil.which("psql"), reason="needs psql")
def test_the_worked_queries_from_psql_give_what_pandas_gives(db_url, jobs, schedule):
    if not db_url.startswith("postgresql"):
        pytest.skip("psql talks to PostgreSQL")
    frames = run_pandas(db_url, jobs["drafting"].id, schedule)
    for query, sql in QUERIES.items():
        rows = psql(db_url, sql, job_id=jobs["drafting"].id, schedule=schedule)
        records = frames[query].to_dict("records")
        assert len(rows) == len(records) > 0, query
        for got, want in zip(rows, records, strict=True):
            assert list(got) == list(want), query  # the same columns, in order
            for column, value in want.items():
                if null(value):
                    assert got[column] == "", (query, column)
                elif isinstance(value, (int, float)):
                    assert float(got[column]) == pytest.approx(float(value), rel=1e-12), (
                        query, column)
                elif isinstance(value, str):
                    assert got[column] == value, (query, column)
                else:  # a timestamp
                    import pandas as pd

                    assert pd.Timestamp(got[column]) == pd.Timestamp(value), (query, column)


def test_the_overview_query_runs(db_url, jobs, schedule):
    section = DOC.split("## Querying the database", 1)[1].split("\n## ", 1)[0]
    (sql,) = re.findall(r"```sql\n(.*?)```", section, re.S)
    (name,) = re.findall(r"schedule = '([^']+)'", sql)
    assert name in load_schedules(Settings().schedules_file)  # a schedule specq ships
    with get_engine(db_url).connect() as conn:
        rows = conn.execute(text(sql.replace(f"'{name}'", f"'{schedule}'"))).all()
    runs = {(r[0], r[1]): r[2] for r in rows}
    assert runs == {("model", "adaptive"): 2, ("prompt_lookup", "adaptive"): 1,
                    ("none", None): 1}
