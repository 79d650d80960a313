"""The SQL views analysts query, as SQLAlchemy sees them (columns and types, for reading).

Created by the migration db/migrations/versions/0005_metrics_views.py (rebuilt by 0006,
0007, 0009 and 0010; 0012 adds one), which defines every figure once, in SQL;
docs/database.md documents every column. These Table objects live in their own MetaData:
Base.metadata describes the tables the migrations build, not the views.

    item_metrics                 one row per item: its counters and figures
    job_metrics                  one row per job: how it drafts, its counts, sums, figures
    job_acceptance_by_position   one row per job and draft position (1 = first draft token)
    job_steps_by_draft_length    one row per job and draft length g: steps run at g
    job_steps_by_drafts_verified one row per job and n: row-steps that verified n drafts (0012)
    schedule_costs               one row per beat schedule and day: its runs' costs (0009)
"""

from __future__ import annotations

from sqlalchemy import Column, Date, DateTime, Float, Integer, MetaData, String, Table, Text

from specq.schema.counters import kinds

VIEWS = MetaData()

# The scalar counters of schema/counters.py (a new one needs a migration that adds it to
# the views: tests/db/test_views.py compares these tables with the views), then the two
# the views derive from steps_by_draft_length.
COUNTERS = (
    *(Column(name, Float if kind == "float" else Integer)
      for name, kind in kinds().items() if kind != "array"),
    Column("steps", Integer),  # sum of steps_by_draft_length: engine steps, g = 0 included
    Column("draft_length_total", Integer),  # sum of g x steps_by_draft_length[g]
)
FIGURES = ("acceptance_rate", "mean_acceptance_length", "mean_draft_length", "tokens_per_pass",
           "tokens_per_second", "engine_tokens_per_second", "estimated_speedup",
           "forced_acceptance_rate")  # the last: of the grammar's drafts (0009)


def _copy(columns: tuple[Column, ...]) -> list[Column]:
    return [c._copy() for c in columns]


def _figures() -> list[Column]:
    return [Column("wall_time", Float), *(Column(name, Float) for name in FIGURES)]


def _saved() -> list[Column]:
    """What speculation saved (0009): target passes, and device seconds at their cost."""
    return [Column("passes_saved", Integer), Column("device_seconds_saved", Float)]


item_metrics = Table(
    "item_metrics", VIEWS,
    Column("job_id", Integer), Column("item_index", Integer), Column("custom_id", String),
    Column("status", String), Column("finish_reason", String), Column("error", Text),
    Column("worker", String), Column("attempts", Integer), Column("retries", Integer),
    Column("crashes", Integer), Column("prompt_tokens", Integer),
    Column("started_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    *_copy(COUNTERS), *_figures(),
    Column("engine_seconds", Float), *_saved(),
)

job_metrics = Table(
    "job_metrics", VIEWS,
    Column("job_id", Integer), Column("status", String), Column("pair", String),
    Column("drafter", String), Column("draft_model", String), Column("draft_length", Integer),
    Column("draft_mode", String), Column("spec", String), Column("schedule", String),
    Column("source", Text), Column("error", Text), Column("created_at", DateTime(timezone=True)),
    Column("started_at", DateTime(timezone=True)), Column("finished_at", DateTime(timezone=True)),
    Column("total", Integer), Column("completed", Integer), Column("failed", Integer),
    Column("cancelled", Integer), Column("pending", Integer),
    *_copy(COUNTERS),
    # faults its chunks met (engine exceptions, workers that died with items in flight),
    # the earliest one's error, and the items that ran alone after a fault struck them
    Column("engine_faults", Integer), Column("first_fault", Text),
    Column("items_isolated", Integer),
    # tokens in, and the device time its chunks' runs held (and its price, where known)
    Column("prompt_tokens", Integer), Column("worker_seconds", Float),
    Column("estimated_cost", Float),
    Column("first_item_started", DateTime(timezone=True)),
    Column("last_item_finished", DateTime(timezone=True)),
    *_figures(), *_saved(),
)

job_acceptance_by_position = Table(
    "job_acceptance_by_position", VIEWS,
    Column("job_id", Integer), Column("draft_position", Integer), Column("accepted", Integer),
    Column("draft_steps", Integer), Column("acceptance", Float),
)

job_steps_by_draft_length = Table(
    "job_steps_by_draft_length", VIEWS,
    Column("job_id", Integer), Column("draft_length", Integer), Column("steps", Integer),
)

job_steps_by_drafts_verified = Table(
    "job_steps_by_drafts_verified", VIEWS,
    Column("job_id", Integer), Column("drafts_verified", Integer), Column("steps", Integer),
)

schedule_costs = Table(
    "schedule_costs", VIEWS,
    Column("schedule", String), Column("day", Date), Column("runs", Integer),
    Column("items", Integer), Column("completed", Integer), Column("failed", Integer),
    Column("prompt_tokens", Integer), Column("new_tokens", Integer),
    Column("worker_seconds", Float), Column("passes_saved", Integer),
    Column("device_seconds_saved", Float), Column("estimated_cost", Float),
)
