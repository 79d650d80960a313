"""tenants, api_keys, files, file_parts and batches: the OpenAI Batch API over HTTP
(`specq serve`), each file and batch owned by the tenant of the key that made it

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-10

New tables only: jobs and items keep their columns (a batch points at its job), so the
metrics views stay as 0007 left them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def _when(name: str, **kw) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), **kw)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        _when("created_at", nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=32), nullable=False),
        _when("created_at", nullable=False),
        _when("revoked_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE",
                                name="fk_api_keys_tenant_id_tenants"),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "batches",
        sa.Column("id", sa.Integer(), autoincrement=True),
        sa.Column("openai_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=True),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=300), nullable=True),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("request_hash", sa.String(length=64), nullable=True),
        _when("created_at", nullable=False),
        _when("expires_at", nullable=False),
        _when("in_progress_at", nullable=True),
        _when("failed_at", nullable=True),
        _when("cancelling_at", nullable=True),
        _when("expired_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE",
                                name="fk_batches_tenant_id_tenants"),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"], ondelete="SET NULL",
                                name="fk_batches_key_id_api_keys"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="SET NULL",
                                name="fk_batches_job_id_jobs"),
        sa.UniqueConstraint("openai_id", name="uq_batches_openai_id"),
        sa.UniqueConstraint("tenant_id", "idempotency_key",
                            name="uq_batches_tenant_id_idempotency_key"),
    )
    op.create_index("ix_batches_tenant_id_id", "batches", ["tenant_id", "id"])
    op.create_index("ix_batches_job_id", "batches", ["job_id"])
    op.create_table(
        "files",
        sa.Column("id", sa.Integer(), autoincrement=True),
        sa.Column("openai_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("lines", sa.Integer(), nullable=True),
        sa.Column("stored_in", sa.String(length=16), nullable=True),
        sa.Column("batch_id", sa.Integer(), nullable=True),
        _when("created_at", nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE",
                                name="fk_files_tenant_id_tenants"),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], ondelete="CASCADE",
                                name="fk_files_batch_id_batches"),
        sa.UniqueConstraint("openai_id", name="uq_files_openai_id"),
    )
    op.create_index("ix_files_tenant_id_id", "files", ["tenant_id", "id"])
    op.create_table(
        "file_parts",
        sa.Column("file_id", sa.Integer(), nullable=False),
        sa.Column("part", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("file_id", "part", name="pk_file_parts"),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], ondelete="CASCADE",
                                name="fk_file_parts_file_id_files"),
    )


def downgrade() -> None:
    op.drop_table("file_parts")
    op.drop_index("ix_files_tenant_id_id", table_name="files")
    op.drop_table("files")
    op.drop_index("ix_batches_job_id", table_name="batches")
    op.drop_index("ix_batches_tenant_id_id", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_api_keys_tenant_id", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
