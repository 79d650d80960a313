"""items.launch and items.crashes (which engine run holds an item, and how many workers died
with it in flight); chunks.faults, first_fault, first_fault_at and isolated (what faults a
chunk met, and how many of its items ran alone after one); item_metrics gains crashes and
job_metrics engine_faults, first_fault and items_isolated

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

An engine failure used to be visible only in a worker's log: the retry ran the items alone
and the job completed, several times slower, with nothing in its metrics to say so. A worker
that died with a poison item in its batch failed every batch-mate once the chunk ran out of
runs. Now a run marks the items of each batch it starts (launch), so the next run can tell
which items were in flight when a worker died (worker/attempts.py), and every fault is
counted on its chunk, whence the views add it up per job. The views keep their columns and
gain the new ones; the figures (FIGURES) and dialect helpers are 0005's.

New columns are added with a plain ALTER TABLE ADD COLUMN (batch mode would rebuild the
tables on SQLite, which the views forbid).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def _revision(name: str) -> Any:
    """The module of an earlier revision file (its views and helpers)."""
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"specq_revision_{path.stem}", path)
    assert spec is not None and spec.loader is not None  # a .py file beside this one
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


V5, V6 = _revision("0005_metrics_views.py"), _revision("0006_fair_dispatch.py")
ALL = ("item_metrics", "job_metrics", "job_acceptance_by_position", "job_steps_by_draft_length")


def item_metrics(d: dict[str, str]) -> str:
    """0005's item_metrics with the item's crashes after its attempts."""
    return V5.item_metrics(d).replace("i.attempts, i.retries,", "i.attempts, i.retries, i.crashes,")


# Per dialect: the first_fault of the job's chunk whose fault came first (first_fault_at),
# as an aggregate over the chunks already joined (a correlated subquery would read them again).
FIRST_FAULT = {
    "postgresql": "(ARRAY_AGG(c.first_fault ORDER BY c.first_fault_at, c.start) "
                  "FILTER (WHERE c.first_fault IS NOT NULL))[1]",
    # the time zero-padded to a fixed width sorts as text as it does as a number
    "sqlite": "substr(MIN(printf('%025.6f', c.first_fault_at) || c.first_fault), 26)",
}


def job_metrics(d: dict[str, str]) -> str:
    """0006's job_metrics with the job's faults: how many its chunks met, the first one's
    error (the earliest by the database's clock), and the items that ran alone after one."""
    base = V6.job_metrics(d)
    first = FIRST_FAULT[op.get_bind().dialect.name]
    faults = f"""COALESCE(SUM(c.faults), 0) AS engine_faults,
               {first} AS first_fault,
               COALESCE(SUM(c.isolated), 0) AS items_isolated,
               MIN(c.first_started) AS first_item_started"""
    marker = "MIN(c.first_started) AS first_item_started"
    assert marker in base
    return base.replace(marker, faults)


VIEWS = {"item_metrics": item_metrics, "job_metrics": job_metrics,
         "job_acceptance_by_position": V6.acceptance_by_position,
         "job_steps_by_draft_length": V6.steps_by_draft_length}
BEFORE = {"item_metrics": V5.item_metrics, "job_metrics": V6.job_metrics,
          "job_acceptance_by_position": V6.acceptance_by_position,
          "job_steps_by_draft_length": V6.steps_by_draft_length}


def _replace_views(views: dict[str, Any]) -> None:
    d = V5.DIALECT[op.get_bind().dialect.name]
    for name in reversed(ALL):
        op.execute(f"DROP VIEW {name}")
    for name in ALL:
        op.execute(f"CREATE VIEW {name} AS {views[name](d)}")


def upgrade() -> None:
    op.add_column("items", sa.Column("launch", sa.String(length=300), nullable=True))
    op.add_column("items", sa.Column("crashes", sa.Integer(), nullable=False,
                                     server_default="0"))
    op.add_column("chunks", sa.Column("faults", sa.Integer(), nullable=False,
                                      server_default="0"))
    op.add_column("chunks", sa.Column("first_fault", sa.Text(), nullable=True))
    op.add_column("chunks", sa.Column("first_fault_at", sa.Float(), nullable=True))
    op.add_column("chunks", sa.Column("isolated", sa.Integer(), nullable=False,
                                      server_default="0"))
    _replace_views(VIEWS)


def downgrade() -> None:
    _replace_views(BEFORE)
    # plain DROP COLUMN (SQLite 3.35 on, PostgreSQL), as 0006's downgrade
    for column in ("isolated", "first_fault_at", "first_fault", "faults"):
        op.execute(f"ALTER TABLE chunks DROP COLUMN {column}")
    for column in ("crashes", "launch"):
        op.execute(f"ALTER TABLE items DROP COLUMN {column}")
