"""What a job cost: chunks.held_seconds, held_since and cost (the device time its runs held
it, and that time priced), chunks.prompt_tokens (its items' tokens in); item_metrics and
job_metrics gain the cost figures, and the view schedule_costs adds them up per schedule
and day

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

A worker holding a chunk's lease is a device spent on its job. Each run charges the chunk
the seconds from its lease to its last write or heartbeat (db/chunks.py: claim, charge,
renew, release), on the database's clock, and the price of a device-hour its worker was
given (SPECQ_DEVICE_HOUR_PRICE, or the pair's preset). A worker killed mid-chunk has
charged its time up to its last heartbeat or write; the run that takes the chunk over
starts its own charge at its own lease, so the lost run is charged once, as spent, and the
time nobody held the chunk is charged to no one. The views keep their columns and gain the
new ones (job_metrics: the sums before first_item_started, the savings at its end).
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


def _revision(name: str) -> Any:
    """The module of an earlier revision file (its views and helpers)."""
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"specq_revision_{path.stem}", path)
    assert spec is not None and spec.loader is not None  # a .py file beside this one
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


V5, V7 = _revision("0005_metrics_views.py"), _revision("0007_faults.py")
DOUBLE = V5.DOUBLE
BEFORE_ALL = V7.ALL
ALL = (*V7.ALL, "schedule_costs")

# Over columns of the same names (an item's counters, or a job's sums): target passes saved
# by speculation (a plain decoder makes one pass per token), and the device time they
# saved at the measured cost of a pass (verify_time / target_passes), less the drafting
# that bought them. Negative: drafting cost more than it saved.
SAVED = """
    m.new_tokens - m.target_passes AS passes_saved,
    (m.new_tokens - m.target_passes) * m.verify_time / NULLIF(m.target_passes, 0)
        - m.draft_time AS device_seconds_saved"""


def item_metrics(d: dict[str, str]) -> str:
    """0007's item_metrics, then the item's engine seconds and what speculation saved."""
    return f"""
SELECT m.*, m.draft_time + m.verify_time AS engine_seconds, {SAVED}
FROM ({V7.item_metrics(d)}
) AS m"""


def job_metrics(d: dict[str, str]) -> str:
    """0007's job_metrics with the job's tokens in, the worker-seconds and cost its chunks
    were charged, and what speculation saved."""
    base = V7.job_metrics(d)
    marker = "MIN(c.first_started) AS first_item_started"
    assert marker in base
    base = base.replace(marker, f"""COALESCE(SUM(c.prompt_tokens), 0) AS prompt_tokens,
               COALESCE(SUM(c.held_seconds), 0) AS worker_seconds,
               SUM(c.cost) AS estimated_cost,
               {marker}""")
    return f"""
SELECT m.*, {SAVED}
FROM ({base}
) AS m"""


# Per dialect: the day (UTC) a job was created on, as a date.
DAY = {"postgresql": "CAST(j.created_at AT TIME ZONE 'UTC' AS DATE)",
       "sqlite": "date(j.created_at)"}


def schedule_costs(d: dict[str, str]) -> str:
    """One row per beat schedule and day (UTC): its runs and what they cost together."""
    day = DAY[op.get_bind().dialect.name]
    return f"""
SELECT j.schedule, {day} AS day, COUNT(*) AS runs,
       SUM(j.total) AS items, SUM(j.completed) AS completed, SUM(j.failed) AS failed,
       SUM(j.prompt_tokens) AS prompt_tokens, SUM(j.new_tokens) AS new_tokens,
       SUM(j.worker_seconds) AS worker_seconds, SUM(j.passes_saved) AS passes_saved,
       SUM(j.device_seconds_saved) AS device_seconds_saved,
       SUM(j.estimated_cost) AS estimated_cost
FROM job_metrics AS j
WHERE j.schedule IS NOT NULL
GROUP BY j.schedule, {day}"""


VIEWS = {**V7.VIEWS, "item_metrics": item_metrics, "job_metrics": job_metrics,
         "schedule_costs": schedule_costs}


def _replace_views(drop: tuple[str, ...], views: dict[str, Any]) -> None:
    d = V5.DIALECT[op.get_bind().dialect.name]
    for name in reversed(drop):
        op.execute(f"DROP VIEW {name}")
    for name in views:
        op.execute(f"CREATE VIEW {name} AS {views[name](d)}")


def upgrade() -> None:
    op.add_column("chunks", sa.Column("prompt_tokens", sa.Integer(), nullable=True))
    op.add_column("chunks", sa.Column("held_seconds", sa.Float(), nullable=False,
                                      server_default="0"))
    op.add_column("chunks", sa.Column("held_since", sa.Float(), nullable=True))
    op.add_column("chunks", sa.Column("cost", sa.Float(), nullable=True))
    # tokens in of the chunks' items written before this revision
    op.execute('UPDATE chunks SET prompt_tokens = (SELECT SUM(i.prompt_tokens) FROM items AS i '
               'WHERE i.job_id = chunks.job_id AND i."index" >= chunks.start '
               'AND i."index" < chunks."end" AND i.draft_steps IS NOT NULL)')
    _replace_views(BEFORE_ALL, VIEWS)


def downgrade() -> None:
    _replace_views(ALL, V7.VIEWS)
    for column in ("cost", "held_since", "held_seconds", "prompt_tokens"):
        op.execute(f"ALTER TABLE chunks DROP COLUMN {column}")
