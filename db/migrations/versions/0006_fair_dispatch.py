"""jobs.priority, chunks.leased_at, the index of unsent chunks; items indexed by
(job_id, status, index) instead of (job_id, status), chunks by (job_id, done, start)
instead of (job_id, done); the sums of each chunk's item counters, which job_metrics,
job_acceptance_by_position and job_steps_by_draft_length now add up

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

A job's chunks are sent a few at a time (the rest wait with sent_at NULL, found by
ix_chunks_unsent), at the job's priority. (job_id, status) let PostgreSQL's planner, with
statistics taken before a bulk insert, serve a chunk's pending items or an item's
write-once UPDATE by scanning every pending item of the job; with the index column added,
each index it may choose narrows to the rows asked for (tests/db/test_plans.py). The same
for chunks.

A job's metrics summed every item's counters (a million JSON arrays for a million-item
job); a chunk now keeps its items' sums (written with them, db/chunks.py: add_sums), and
the job views add up chunks. The figures (FIGURES) and dialect helpers are 0005's.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def _revision_0005() -> Any:
    """The module of revision 0005 (its FIGURES, DIALECT and view definitions)."""
    path = Path(__file__).with_name("0005_metrics_views.py")
    spec = importlib.util.spec_from_file_location("specq_revision_0005", path)
    assert spec is not None and spec.loader is not None  # a .py file beside this one
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


V5 = _revision_0005()
SCALARS, ARRAYS = V5.SCALARS, ("accepted_by_position", "steps_by_draft_length")
REPLACED = ("job_acceptance_by_position", "job_steps_by_draft_length", "job_metrics")


def job_metrics(d: dict[str, str]) -> str:
    """0005's job_metrics, its columns in the same order, with the counts by status, the
    sums, first start and last finish added up from the job's chunks (pending: the rest of
    its items)."""
    ended = [s for s in V5.ITEM_STATUSES if s != "pending"]
    counts = ",\n               ".join(
        [f"COALESCE(SUM(c.{s}), 0) AS {s}" for s in ended]
        + [f"j.total - {' - '.join(f'COALESCE(SUM(c.{s}), 0)' for s in ended)} AS pending"])
    sums = ",\n               ".join(
        [f"COALESCE(SUM(c.{x}), 0) AS {x}" for x in SCALARS]
        + [f"COALESCE(SUM({d['array_sum'].format(col='c.steps_by_draft_length')}), 0) AS steps",
           f"COALESCE(SUM({d['weighted_sum'].format(col='c.steps_by_draft_length')}), 0) "
           "AS draft_length_total"])
    job_columns = ", ".join(f"j.{c}" for c in V5.JOB_COLUMNS)
    return f"""
SELECT m.*, {V5.FIGURES}
FROM (
    SELECT a.*, {d["seconds"].format(a="a.first_item_started", b="a.last_item_finished")}
               AS wall_time
    FROM (
        SELECT j.id AS job_id, {job_columns},
               {counts},
               {sums},
               MIN(c.first_started) AS first_item_started,
               MAX(c.last_finished) AS last_item_finished
        FROM jobs AS j LEFT JOIN chunks AS c ON c.job_id = j.id
        GROUP BY j.id, {job_columns}
    ) AS a
) AS m"""


def by_element(d: dict[str, str], col: str, pos: str, pos_name: str, n_name: str) -> str:
    """0005's by_element over the chunks' sums instead of the items."""
    return f"""
    SELECT i.job_id, {pos} AS {pos_name}, SUM({d["n"]}) AS {n_name}
    FROM chunks AS i, {d["elements"].format(col=f"i.{col}")}
    GROUP BY i.job_id, {pos}"""


def acceptance_by_position(d: dict[str, str]) -> str:
    rows = by_element(d, "accepted_by_position", f"{d['pos']} + 1", "draft_position",
                      "accepted")
    return f"""
SELECT p.job_id, p.draft_position, p.accepted, j.draft_steps,
       CAST(p.accepted AS {V5.DOUBLE}) / NULLIF(j.draft_steps, 0) AS acceptance
FROM ({rows}
) AS p JOIN job_metrics AS j ON j.job_id = p.job_id"""


def steps_by_draft_length(d: dict[str, str]) -> str:
    return by_element(d, "steps_by_draft_length", d["pos"], "draft_length", "steps")


VIEWS = {"job_metrics": job_metrics, "job_acceptance_by_position": acceptance_by_position,
         "job_steps_by_draft_length": steps_by_draft_length}


def _sum_chunks() -> None:
    """Every chunk's counts and sums, from its items (jobs stored before this revision)."""
    conn = op.get_bind()
    for status in ("completed", "failed", "cancelled"):
        conn.execute(sa.text(
            f"UPDATE chunks SET {status} = (SELECT COUNT(*) FROM items AS i WHERE "
            f'i.job_id = chunks.job_id AND i."index" >= chunks.start AND i."index" < '
            f"chunks.\"end\" AND i.status = '{status}')"))
    cols = ", ".join((*SCALARS, *ARRAYS))
    chunks = conn.execute(sa.text('SELECT job_id, start, "end" FROM chunks')).all()
    for job_id, start, end in chunks:
        rows = conn.execute(sa.text(
            f'SELECT started_at, finished_at, {cols} FROM items WHERE job_id = :j '
            f'AND "index" >= :s AND "index" < :e AND draft_steps IS NOT NULL'),
            {"j": job_id, "s": start, "e": end}).all()
        if not rows:
            continue
        sums: dict[str, Any] = {x: 0 for x in SCALARS}
        arrays: dict[str, list[int]] = {x: [] for x in ARRAYS}
        first = last = None
        for started, finished, *values in rows:
            for x, v in zip(SCALARS, values):
                sums[x] += v or 0
            for x, v in zip(ARRAYS, values[len(SCALARS):]):
                v = json.loads(v) if isinstance(v, str) else (v or [])
                arrays[x] += [0] * (len(v) - len(arrays[x]))
                arrays[x] = [a + b for a, b in zip(arrays[x], v + [0] * len(arrays[x]))]
            first = started if first is None or (started and started < first) else first
            last = finished if last is None or (finished and finished > last) else last
        conn.execute(sa.text(
            "UPDATE chunks SET " + ", ".join(f"{x} = :{x}" for x in (*SCALARS, *ARRAYS))
            + ', first_started = :first, last_finished = :last '
            'WHERE job_id = :j AND start = :s'),
            {**sums, **{x: json.dumps(v) for x, v in arrays.items()}, "first": first,
             "last": last, "j": job_id, "s": start})


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("priority", sa.String(length=8), nullable=False,
                                   server_default="normal"))
    with op.batch_alter_table("chunks") as batch:
        batch.add_column(sa.Column("leased_at", sa.Float(), nullable=True))
    op.create_index("ix_chunks_unsent", "chunks", ["job_id", "start"], unique=False,
                    postgresql_where=sa.text("sent_at IS NULL"),
                    sqlite_where=sa.text("sent_at IS NULL"))
    op.create_index("ix_items_job_id_status_index", "items", ["job_id", "status", "index"],
                    unique=False)
    op.drop_index("ix_items_job_id_status", table_name="items")
    op.create_index("ix_chunks_job_id_done_start", "chunks", ["job_id", "done", "start"],
                    unique=False)
    op.drop_index("ix_chunks_job_id_done", table_name="chunks")
    with op.batch_alter_table("chunks") as batch:
        for status in ("completed", "failed", "cancelled"):
            batch.add_column(sa.Column(status, sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("first_started", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("last_finished", sa.DateTime(timezone=True), nullable=True))
        for x in SCALARS:
            kind = sa.Float() if x.endswith("_time") else sa.Integer()
            batch.add_column(sa.Column(x, kind, nullable=True))
        for x in ARRAYS:
            batch.add_column(sa.Column(x, sa.JSON(), nullable=True))
    _sum_chunks()
    d = V5.DIALECT[op.get_bind().dialect.name]
    for name in REPLACED:
        op.execute(f"DROP VIEW {name}")
    for name in reversed(REPLACED):
        op.execute(f"CREATE VIEW {name} AS {VIEWS[name](d)}")


def downgrade() -> None:
    d = V5.DIALECT[op.get_bind().dialect.name]
    for name in REPLACED:
        op.execute(f"DROP VIEW {name}")
    for name in reversed(REPLACED):
        op.execute(f"CREATE VIEW {name} AS {V5.VIEWS[name](d)}")
    for x in (*SCALARS, *ARRAYS, "first_started", "last_finished", "completed", "failed",
              "cancelled"):
        op.execute(f"ALTER TABLE chunks DROP COLUMN {x}")
    op.create_index("ix_chunks_job_id_done", "chunks", ["job_id", "done"], unique=False)
    op.drop_index("ix_chunks_job_id_done_start", table_name="chunks")
    op.create_index("ix_items_job_id_status", "items", ["job_id", "status"], unique=False)
    op.drop_index("ix_items_job_id_status_index", table_name="items")
    op.drop_index("ix_chunks_unsent", table_name="chunks")
    # a plain DROP COLUMN (SQLite 3.35 on, PostgreSQL): batch mode would rebuild jobs on
    # SQLite, which the views of 0005 forbid; they do not read these columns
    op.execute("ALTER TABLE chunks DROP COLUMN leased_at")
    op.execute("ALTER TABLE jobs DROP COLUMN priority")
