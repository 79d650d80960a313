"""jobs.drafter, jobs.draft_model, jobs.draft_length, jobs.draft_mode (how the job's pair
drafts), and the views analysts query: item_metrics, job_metrics,
job_acceptance_by_position, job_steps_by_draft_length

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Every derived figure is defined here, once, in FIGURES: over one item's counters in
item_metrics, over the sums of a job's counters in job_metrics (a job's rate is a ratio of
sums, never a mean of item rates). The rates divide by NULLIF(denominator, 0): NULL where
Python's metrics (api/client.py: JobMetrics) say None. Only reading JSON arrays and
subtracting timestamps differ between SQLite and PostgreSQL (DIALECT).

A later migration that rebuilds jobs or items on SQLite (batch_alter_table dropping or
altering a column: copy, drop, rename) must drop these views first and create them again
after: SQLite refuses to rename a table while a view names one that is missing. On
PostgreSQL a column the views read cannot be dropped or retyped while they exist either.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

log = logging.getLogger(__name__)

DOUBLE = "DOUBLE PRECISION"  # REAL affinity in SQLite; not REAL, which is float4 in PostgreSQL

# The figures, over columns of the same names: an item's counters, or a job's sums of them.
# steps: engine steps (all draft lengths, g = 0 included); draft_length_total: the sum over
# those steps of the draft length g each ran with; wall_time: seconds, first start to last
# finish.
FIGURES = f"""
    CAST(m.accepted AS {DOUBLE}) / NULLIF(m.proposed, 0) AS acceptance_rate,
    1 + CAST(m.accepted AS {DOUBLE}) / NULLIF(m.draft_steps, 0) AS mean_acceptance_length,
    CAST(m.draft_length_total AS {DOUBLE}) / NULLIF(m.steps, 0) AS mean_draft_length,
    CAST(m.new_tokens AS {DOUBLE}) / NULLIF(m.target_passes, 0) AS tokens_per_pass,
    m.new_tokens / NULLIF(m.wall_time, 0) AS tokens_per_second,
    m.new_tokens / NULLIF(m.draft_time + m.verify_time, 0) AS engine_tokens_per_second,
    CAST(m.new_tokens AS {DOUBLE}) / NULLIF(m.target_passes, 0)
        * m.verify_time / NULLIF(m.draft_time + m.verify_time, 0) AS estimated_speedup"""

# Per dialect: {seconds}: the seconds from {a} to {b}; {array_sum}: the sum of the JSON
# array counter {col}, {weighted_sum}: the sum of position x element ({col}[g] x g), both
# NULL unless {col} holds an array; {elements}: the rows (pos, n) of {col}, pos from 0, none
# unless {col} holds an array.
DIALECT = {
    "sqlite": {
        # whole seconds by strftime('%s') of 'YYYY-MM-DD HH:MM:SS', plus the fraction after
        # them (SQLAlchemy stores microseconds; julianday() would keep milliseconds only)
        "seconds": "(CAST(strftime('%s', substr({b}, 1, 19)) AS INTEGER) "
                   "- CAST(strftime('%s', substr({a}, 1, 19)) AS INTEGER) "
                   "+ (CAST(substr({b}, 20) AS REAL) - CAST(substr({a}, 20) AS REAL)))",
        "array_sum": "CASE WHEN json_type({col}) = 'array' THEN "
                     "(SELECT COALESCE(SUM(e.value), 0) FROM json_each({col}) AS e) END",
        "weighted_sum": "CASE WHEN json_type({col}) = 'array' THEN "
                        "(SELECT COALESCE(SUM(e.key * e.value), 0) FROM json_each({col}) AS e) "
                        "END",
        "elements": "json_each(CASE WHEN json_type({col}) = 'array' THEN {col} END) AS e",
        "pos": "CAST(e.key AS INTEGER)",
        "n": "e.value",
    },
    "postgresql": {
        "seconds": f"CAST(EXTRACT(EPOCH FROM ({{b}} - {{a}})) AS {DOUBLE})",
        "array_sum": "CASE WHEN json_typeof({col}) = 'array' THEN "
                     "CAST((SELECT COALESCE(SUM(e.n::int), 0) "
                     "FROM json_array_elements_text({col}) AS e(n)) AS INTEGER) END",
        "weighted_sum": "CASE WHEN json_typeof({col}) = 'array' THEN "
                        "CAST((SELECT COALESCE(SUM((e.ord - 1) * e.n::int), 0) FROM "
                        "json_array_elements_text({col}) WITH ORDINALITY AS e(n, ord)) AS INTEGER)"
                        " END",
        "elements": "json_array_elements_text(CASE WHEN json_typeof({col}) = 'array' "
                    "THEN {col} END) WITH ORDINALITY AS e(n, ord)",
        "pos": "CAST(e.ord - 1 AS INTEGER)",
        "n": "e.n::int",
    },
}

SCALARS = ("draft_steps", "proposed", "accepted", "target_passes", "new_tokens", "draft_time",
           "verify_time")
JOB_COLUMNS = ("status", "pair", "drafter", "draft_model", "draft_length", "draft_mode",
               "spec", "schedule", "source", "error", "created_at", "started_at",
               "finished_at", "total")
ITEM_STATUSES = ("completed", "failed", "cancelled", "pending")


def item_metrics(d: dict[str, str]) -> str:
    """One row per item: what it is, its counters, and FIGURES over them (NULL for an item
    that never reached the engine: its counters are NULL)."""
    scalars = ", ".join(f"i.{c}" for c in SCALARS)
    return f"""
SELECT m.*, {FIGURES}
FROM (
    SELECT i.job_id, i."index" AS item_index, i.custom_id, i.status, i.finish_reason, i.error,
           i.worker, i.attempts, i.retries, i.prompt_tokens, i.started_at, i.finished_at,
           {scalars},
           {d["array_sum"].format(col="i.steps_by_draft_length")} AS steps,
           {d["weighted_sum"].format(col="i.steps_by_draft_length")} AS draft_length_total,
           {d["seconds"].format(a="i.started_at", b="i.finished_at")} AS wall_time
    FROM items AS i
) AS m"""


def job_metrics(d: dict[str, str]) -> str:
    """One row per job: its columns, item counts by status, sums of the item counters (0
    where no item has them), the first start and last finish of the items that reached the
    engine, and FIGURES over the sums."""
    counts = ",\n           ".join(
        f"COUNT(CASE WHEN i.status = '{s}' THEN 1 END) AS {s}" for s in ITEM_STATUSES)
    sums = ",\n           ".join(
        f"COALESCE(SUM(i.{c}), 0) AS {c}" for c in (*SCALARS, "steps", "draft_length_total"))
    job_columns = ", ".join(f"j.{c}" for c in JOB_COLUMNS)
    return f"""
SELECT m.*, {FIGURES}
FROM (
    SELECT a.*, {d["seconds"].format(a="a.first_item_started", b="a.last_item_finished")}
               AS wall_time
    FROM (
        SELECT j.id AS job_id, {job_columns},
               {counts},
               {sums},
               MIN(CASE WHEN i.draft_steps IS NOT NULL THEN i.started_at END)
                   AS first_item_started,
               MAX(CASE WHEN i.draft_steps IS NOT NULL THEN i.finished_at END)
                   AS last_item_finished
        FROM jobs AS j LEFT JOIN item_metrics AS i ON i.job_id = j.id
        GROUP BY j.id, {job_columns}
    ) AS a
) AS m"""


def by_element(d: dict[str, str], col: str, pos: str, pos_name: str, n_name: str) -> str:
    """One row per job and element of the JSON array counter ``col``: the element's sum over
    the job's items (``pos``: the element's position, from 0, as SQL)."""
    return f"""
    SELECT i.job_id, {pos} AS {pos_name}, SUM({d["n"]}) AS {n_name}
    FROM items AS i, {d["elements"].format(col=f"i.{col}")}
    GROUP BY i.job_id, {pos}"""


def acceptance_by_position(d: dict[str, str]) -> str:
    """One row per job and draft position (1: the first draft token of a step): draft tokens
    accepted there, the job's draft steps, and their ratio (the share of draft steps whose
    token at that position was accepted)."""
    rows = by_element(d, "accepted_by_position", f"{d['pos']} + 1", "draft_position",
                      "accepted")
    return f"""
SELECT p.job_id, p.draft_position, p.accepted, j.draft_steps,
       CAST(p.accepted AS {DOUBLE}) / NULLIF(j.draft_steps, 0) AS acceptance
FROM ({rows}
) AS p JOIN job_metrics AS j ON j.job_id = p.job_id"""


def steps_by_draft_length(d: dict[str, str]) -> str:
    """One row per job and draft length g: the engine steps its items ran at g."""
    return by_element(d, "steps_by_draft_length", d["pos"], "draft_length", "steps")


VIEWS = {  # in creation order; dropped in reverse
    "item_metrics": item_metrics,
    "job_metrics": job_metrics,
    "job_acceptance_by_position": acceptance_by_position,
    "job_steps_by_draft_length": steps_by_draft_length,
}


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("drafter", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("draft_model", sa.String(length=300), nullable=True))
        batch.add_column(sa.Column("draft_length", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("draft_mode", sa.String(length=16), nullable=True))
    _backfill_drafting()
    d = DIALECT[op.get_bind().dialect.name]
    for name, sql in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql(d)}")


def _backfill_drafting() -> None:
    """Jobs stored before: how their pair drafts, from today's presets (built-in and
    SPECQ_PRESETS_FILE); NULL for a pair no preset names, or if the presets cannot be read."""
    from specq.configs.presets import PresetError, load_presets
    from specq.configs.settings import get_settings

    conn = op.get_bind()
    pairs = [p for (p,) in conn.execute(sa.text("SELECT DISTINCT pair FROM jobs"))]
    if not pairs:
        return
    try:
        presets = load_presets(get_settings().presets_file)
    except PresetError as exc:
        log.warning("jobs stored before revision 0005 keep no drafter: %s", exc)
        return
    for pair in pairs:
        if pair in presets:
            conn.execute(sa.text("UPDATE jobs SET drafter = :drafter, draft_model = :draft_model,"
                                 " draft_length = :draft_length, draft_mode = :draft_mode "
                                 "WHERE pair = :pair"),
                         {**presets[pair].drafting(), "pair": pair})


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("draft_mode")
        batch.drop_column("draft_length")
        batch.drop_column("draft_model")
        batch.drop_column("drafter")
