"""deleted_files: a deleted file's id and its place in its tenant's listing

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06

A listing is paged by the last id a client was given (``after``); a client that deletes the
files it lists (the SDKs' auto-pagination in a delete loop) asks for the page after a file
that is gone. The file's row id, kept here, still places it (db/batches.py: ``_page``). The
retention sweep deletes these rows after db/retention.py's DELETED_FILES_KEPT.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deleted_files",
        sa.Column("openai_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("openai_id", name="pk_deleted_files"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE",
                                name="fk_deleted_files_tenant_id_tenants"),
    )
    op.create_index("ix_deleted_files_deleted_at", "deleted_files", ["deleted_at"])


def downgrade() -> None:
    op.drop_table("deleted_files")
