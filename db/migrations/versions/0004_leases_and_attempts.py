"""chunks (leases, dispatch records), jobs.queue, items.attempts / items.retries: what a
worker runs, until when, where its messages go, and how often an item's generation failed

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("attempts", sa.Integer(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("retries", sa.Integer(), nullable=False,
                                   server_default="0"))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("queue", sa.String(length=300), nullable=True))
    chunks = op.create_table(
        "chunks",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("start", sa.Integer(), nullable=False),
        sa.Column("end", sa.Integer(), nullable=False),
        sa.Column("done", sa.Boolean(), nullable=False),
        sa.Column("lease_owner", sa.String(length=300), nullable=True),
        sa.Column("lease_until", sa.Float(), nullable=True),
        sa.Column("sent_at", sa.Float(), nullable=True),
        sa.Column("sends", sa.Integer(), nullable=False),
        sa.Column("runs", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_chunks_job_id_jobs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "start", name=op.f("pk_chunks")),
    )
    op.create_index("ix_chunks_job_id_done", "chunks", ["job_id", "done"], unique=False)
    # the chunks of jobs stored before this revision; a finished job's are done
    conn = op.get_bind()
    jobs = conn.execute(sa.text("SELECT id, pair, total, chunk_size, status FROM jobs")).all()
    from specq.configs.settings import get_settings  # the queues jobs were sent to so far

    prefix = get_settings().queue_prefix
    for j in jobs:
        conn.execute(sa.text("UPDATE jobs SET queue = :q WHERE id = :id"),
                     {"q": f"{prefix}.{j.pair}", "id": j.id})
    finished = {"completed", "failed", "cancelled"}
    rows = [{"job_id": j.id, "start": s, "end": min(s + j.chunk_size, j.total),
             "done": j.status in finished, "sends": 1, "runs": 0}
            for j in jobs for s in range(0, j.total, max(1, j.chunk_size))]
    if rows:
        op.bulk_insert(chunks, rows)


def downgrade() -> None:
    op.drop_index("ix_chunks_job_id_done", table_name="chunks")
    op.drop_table("chunks")
    with op.batch_alter_table("items") as batch:
        batch.drop_column("retries")
        batch.drop_column("attempts")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("queue")
