"""webhook_endpoints, webhook_deliveries (the outbox) and webhook_attempts: the producer is
told when a batch or a job ends; files gain expires_at and jobs swept_at (retention)

Revision ID: 0011_webhooks_and_retention
Revises: 0010
Create Date: 2026-12-02

New tables, and a nullable column on files and on jobs: the metrics views stay as 0010 left
them (they name their columns).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_webhooks_and_retention"
down_revision = "0010"
branch_labels = None
depends_on = None


# the columns of webhook_endpoints other roles may read: all but the secrets
READABLE = "id, openai_id, tenant_id, name, url, event_types, created_at, updated_at"


def _when(name: str, **kw) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), **kw)


def upgrade() -> None:
    op.add_column("jobs", _when("swept_at", nullable=True))
    op.add_column("files", _when("expires_at", nullable=True))
    op.create_index("ix_files_expires_at", "files", ["expires_at"])
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.Integer(), autoincrement=True),
        sa.Column("openai_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("event_types", sa.JSON(), nullable=False),
        sa.Column("secret", sa.String(length=100), nullable=False),
        sa.Column("previous_secret", sa.String(length=100), nullable=True),
        sa.Column("previous_until", sa.Float(), nullable=True),
        _when("created_at", nullable=False),
        _when("updated_at", nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_endpoints"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE",
                                name="fk_webhook_endpoints_tenant_id_tenants"),
        sa.UniqueConstraint("openai_id", name="uq_webhook_endpoints_openai_id"),
    )
    op.create_index("ix_webhook_endpoints_tenant_id", "webhook_endpoints", ["tenant_id"])
    if op.get_bind().dialect.name == "postgresql":
        # the analysts' read-only role (db/readonly.sql) got SELECT on the new table by
        # default privileges: every column but the signing secrets
        op.execute(f"""
        DO $$
        DECLARE r record;
        BEGIN
          FOR r IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
                   WHERE table_schema = current_schema() AND table_name = 'webhook_endpoints'
                     AND privilege_type = 'SELECT' AND grantee NOT IN (current_user, 'PUBLIC')
          LOOP
            EXECUTE format('REVOKE SELECT ON webhook_endpoints FROM %I', r.grantee);
            EXECUTE format('GRANT SELECT ({READABLE}) ON webhook_endpoints TO %I', r.grantee);
          END LOOP;
        END $$""")
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Integer(), autoincrement=True),
        sa.Column("event_id", sa.String(length=64), nullable=False),
        sa.Column("endpoint_id", sa.Integer(), nullable=False),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created", sa.Float(), nullable=False),
        sa.Column("next_at", sa.Float(), nullable=False),
        sa.Column("lease_owner", sa.String(length=300), nullable=True),
        sa.Column("lease_until", sa.Float(), nullable=True),
        sa.Column("delivered_at", sa.Float(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_deliveries"),
        sa.ForeignKeyConstraint(["endpoint_id"], ["webhook_endpoints.id"], ondelete="CASCADE",
                                name="fk_webhook_deliveries_endpoint_id_webhook_endpoints"),
        sa.UniqueConstraint("event_id", "endpoint_id",
                            name="uq_webhook_deliveries_event_id_endpoint_id"),
    )
    op.create_index("ix_webhook_deliveries_endpoint_id", "webhook_deliveries", ["endpoint_id"])
    op.create_index("ix_webhook_deliveries_status_next_at", "webhook_deliveries",
                    ["status", "next_at"])
    op.create_table(
        "webhook_attempts",
        sa.Column("id", sa.Integer(), autoincrement=True),
        sa.Column("delivery_id", sa.Integer(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("sender", sa.String(length=300), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_attempts"),
        sa.ForeignKeyConstraint(["delivery_id"], ["webhook_deliveries.id"], ondelete="CASCADE",
                                name="fk_webhook_attempts_delivery_id_webhook_deliveries"),
    )
    op.create_index("ix_webhook_attempts_delivery_id", "webhook_attempts", ["delivery_id"])


def downgrade() -> None:
    op.drop_table("webhook_attempts")
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_endpoints")
    op.drop_index("ix_files_expires_at", table_name="files")
    # plain DROP COLUMN, as 0010: SQLite rebuilding jobs would break the views on it
    op.execute("ALTER TABLE files DROP COLUMN expires_at")
    op.execute("ALTER TABLE jobs DROP COLUMN swept_at")
