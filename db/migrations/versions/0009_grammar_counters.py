"""items and chunks gain forced_proposed, forced_accepted and mask_time (a row shaped by a
grammar: the tokens its grammar forced, drafted for free, and its share of the mask's cost);
item_metrics and job_metrics gain them and forced_acceptance_rate

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-11

A request's response_format (schema/grammar.py) constrains its output with a grammar, and
what the grammar fixes (keys, quotes, braces, the rest of an enum value) is proposed as a
draft by the grammar itself (worker/engine/grammar.py). Those drafts are counted apart, so
acceptance by source is visible: proposed and accepted keep counting every draft token, and
forced_proposed, forced_accepted say how many of them the grammar drafted. The views keep
their columns and gain the new ones after verify_time, and forced_acceptance_rate after the
other figures. Plain ALTER TABLE ADD COLUMN, as 0007.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

COUNTERS = (("forced_proposed", sa.Integer()), ("forced_accepted", sa.Integer()),
            ("mask_time", sa.Float()))


def _revision(name: str) -> Any:
    """The module of an earlier revision file (its views and helpers)."""
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"specq_revision_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


V5, V7 = _revision("0005_metrics_views.py"), _revision("0007_faults.py")
FIGURE = (f"CAST(m.forced_accepted AS {V5.DOUBLE}) / NULLIF(m.forced_proposed, 0) "
          "AS forced_acceptance_rate")


def _with_figure(sql: str) -> str:
    head = f"SELECT m.*, {V5.FIGURES}"
    assert head in sql
    return sql.replace(head, f"{head},\n    {FIGURE}", 1)


def item_metrics(d: dict[str, str]) -> str:
    """0007's item_metrics with the grammar's counters after verify_time."""
    base = V7.item_metrics(d)
    marker = "i.verify_time,"
    assert marker in base
    return _with_figure(base.replace(
        marker, "i.verify_time, i.forced_proposed, i.forced_accepted, i.mask_time,", 1))


def job_metrics(d: dict[str, str]) -> str:
    """0007's job_metrics with the sums of the grammar's counters (from the chunks) after
    verify_time's."""
    base = V7.job_metrics(d)
    marker = "COALESCE(SUM(c.verify_time), 0) AS verify_time"
    assert marker in base
    sums = ",\n               ".join(
        [marker] + [f"COALESCE(SUM(c.{c}), 0) AS {c}" for c, _ in COUNTERS])
    return _with_figure(base.replace(marker, sums, 1))


VIEWS = {**V7.VIEWS, "item_metrics": item_metrics, "job_metrics": job_metrics}


def _replace_views(views: dict[str, Any]) -> None:
    d = V5.DIALECT[op.get_bind().dialect.name]
    for name in reversed(V7.ALL):
        op.execute(f"DROP VIEW {name}")
    for name in V7.ALL:
        op.execute(f"CREATE VIEW {name} AS {views[name](d)}")


def upgrade() -> None:
    for table in ("items", "chunks"):
        for name, kind in COUNTERS:
            op.add_column(table, sa.Column(name, kind, nullable=True))
    _replace_views(VIEWS)


def downgrade() -> None:
    _replace_views(V7.VIEWS)
    for table in ("chunks", "items"):
        for name, _ in reversed(COUNTERS):
            op.execute(f"ALTER TABLE {table} DROP COLUMN {name}")
