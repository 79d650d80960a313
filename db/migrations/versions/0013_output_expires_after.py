"""batches gain output_expires_after: the seconds, counted from the batch's end, after which
its output and error files expire (the create's OpenAI output_expires_after)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05

The retention sweep gives a finished batch's output and error files their expires_at (its
job's finished_at plus these seconds) and deletes them once it passed (db/retention.py).
Batches stored before this revision have none (NULL): the operator's retention_outputs
alone, as before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("output_expires_after", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.execute("ALTER TABLE batches DROP COLUMN output_expires_after")
