"""items and chunks gain forced_proposed, forced_accepted and mask_time (a row shaped by a
grammar: the tokens its grammar forced, drafted for free, and its share of the mask's cost);
item_metrics and job_metrics gain them and forced_acceptance_rate

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

A request's response_format (schema/grammar.py) constrains its output with a grammar, and
what the grammar fixes (keys, quotes, braces, the rest of an enum value) is proposed as a
draft by the grammar itself (worker/engine/grammar.py). Those drafts are counted apart, so
acceptance by source is visible: proposed and accepted keep counting every draft token, and
forced_proposed, forced_accepted say how many of them the grammar drafted. The views keep
their columns (0009's included) and gain the new ones after verify_time, and
forced_acceptance_rate after the other figures. Plain ALTER TABLE ADD COLUMN, as 0007.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

COUNTERS = (("forced_proposed", sa.Integer()), ("forced_accepted", sa.Integer()),
            ("mask_time", sa.Float()))


def _revision(name: str) -> Any:
    """The module of an earlier revision file (its views and helpers)."""
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"specq_revision_{path.stem}", path)
    assert spec is not None and spec.loader is not None  # a .py file beside this one
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


V5, V7, V9 = (_revision("0005_metrics_views.py"), _revision("0007_faults.py"),
              _revision("0009_costs.py"))
FIGURE = (f"CAST(m.forced_accepted AS {V5.DOUBLE}) / NULLIF(m.forced_proposed, 0) "
          "AS forced_acceptance_rate")


def _with_figure(sql: str) -> str:
    head = f"SELECT m.*, {V5.FIGURES}"
    assert head in sql
    return sql.replace(head, f"{head},\n    {FIGURE}", 1)


def _replaced(sql: str, marker: str, by: str) -> str:
    assert marker in sql, marker
    return sql.replace(marker, by, 1)


def item_metrics(d: dict[str, str]) -> str:
    """0009's item_metrics with the grammar's counters after verify_time."""
    base = _with_figure(_replaced(
        V7.item_metrics(d), "i.verify_time,",
        "i.verify_time, i.forced_proposed, i.forced_accepted, i.mask_time,"))
    return f"""
SELECT m.*, m.draft_time + m.verify_time AS engine_seconds, {V9.SAVED}
FROM ({base}
) AS m"""


def job_metrics(d: dict[str, str]) -> str:
    """0009's job_metrics with the sums of the grammar's counters (from the chunks) after
    verify_time's."""
    verify = "COALESCE(SUM(c.verify_time), 0) AS verify_time"
    sums = ",\n               ".join(
        [verify] + [f"COALESCE(SUM(c.{c}), 0) AS {c}" for c, _ in COUNTERS])
    first = "MIN(c.first_started) AS first_item_started"
    base = _with_figure(_replaced(_replaced(V7.job_metrics(d), verify, sums), first,
                                  f"""COALESCE(SUM(c.prompt_tokens), 0) AS prompt_tokens,
               COALESCE(SUM(c.held_seconds), 0) AS worker_seconds,
               SUM(c.cost) AS estimated_cost,
               {first}"""))
    return f"""
SELECT m.*, {V9.SAVED}
FROM ({base}
) AS m"""


VIEWS = {**V9.VIEWS, "item_metrics": item_metrics, "job_metrics": job_metrics}


def _replace_views(views: dict[str, Any]) -> None:
    d = V5.DIALECT[op.get_bind().dialect.name]
    for name in reversed(V9.ALL):
        op.execute(f"DROP VIEW {name}")
    for name in V9.ALL:
        op.execute(f"CREATE VIEW {name} AS {views[name](d)}")


def upgrade() -> None:
    for table in ("items", "chunks"):
        for name, kind in COUNTERS:
            op.add_column(table, sa.Column(name, kind, nullable=True))
    _replace_views(VIEWS)


def downgrade() -> None:
    _replace_views(V9.VIEWS)
    for table in ("chunks", "items"):
        for name, _ in reversed(COUNTERS):
            op.execute(f"ALTER TABLE {table} DROP COLUMN {name}")
