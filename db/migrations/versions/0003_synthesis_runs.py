"""jobs.spec, jobs.schedule, jobs.synthesis, jobs.output_path: which synthesis spec and beat
schedule produced a job, the resolved spec, and where its data set was written

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("spec", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("schedule", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("synthesis", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("output_path", sa.Text(), nullable=True))
        batch.create_index("ix_jobs_schedule", ["schedule"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_schedule")
        batch.drop_column("output_path")
        batch.drop_column("synthesis")
        batch.drop_column("schedule")
        batch.drop_column("spec")
