"""items and chunks gain steps_by_drafts_verified (per row: steps by the number of draft
tokens it verified); the view job_steps_by_drafts_verified sums it per job

Revision ID: 0012
Revises: 0011_webhooks_and_retention
Create Date: 2026-12-03

A step's rows carry their own number of draft tokens (the step's budget cuts each row to
what pays: worker/engine/budget.py; a grammar forces tokens at any g), so one g per step no
longer says what was verified. The new JSON array counts, per item, its steps by the draft
tokens it verified, the grammar's included; a chunk keeps its items' element-wise sum, as
for the other arrays (db/chunks.py), and the view adds up the chunks (0006's by_element).
Items and chunks stored before this revision have none (NULL): the view skips them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011_webhooks_and_retention"
branch_labels = None
depends_on = None

COUNTER = "steps_by_drafts_verified"
VIEW = "job_steps_by_drafts_verified"


def _revision(name: str) -> Any:
    """The module of an earlier revision file (its views and helpers)."""
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"specq_revision_{path.stem}", path)
    assert spec is not None and spec.loader is not None  # a .py file beside this one
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


V5, V6 = _revision("0005_metrics_views.py"), _revision("0006_fair_dispatch.py")


def steps_by_drafts_verified(d: dict[str, str]) -> str:
    """One row per job and number of draft tokens verified by a row in a step: how many
    such row-steps its items ran."""
    return V6.by_element(d, COUNTER, d["pos"], "drafts_verified", "steps")


def upgrade() -> None:
    for table in ("items", "chunks"):
        op.add_column(table, sa.Column(COUNTER, sa.JSON(), nullable=True))
    d = V5.DIALECT[op.get_bind().dialect.name]
    op.execute(f"CREATE VIEW {VIEW} AS {steps_by_drafts_verified(d)}")


def downgrade() -> None:
    op.execute(f"DROP VIEW {VIEW}")
    for table in ("chunks", "items"):
        op.execute(f"ALTER TABLE {table} DROP COLUMN {COUNTER}")
