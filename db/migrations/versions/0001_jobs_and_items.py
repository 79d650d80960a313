"""jobs and items

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('jobs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('pair', sa.String(length=200), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('total', sa.Integer(), nullable=False),
    sa.Column('chunk_size', sa.Integer(), nullable=False),
    sa.Column('source', sa.Text(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    op.create_table('items',
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('custom_id', sa.String(length=512), nullable=True),
    sa.Column('prompt', sa.Text(), nullable=True),
    sa.Column('messages', sa.JSON(), nullable=True),
    sa.Column('params', sa.JSON(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('output', sa.Text(), nullable=True),
    sa.Column('token_ids', sa.JSON(), nullable=True),
    sa.Column('finish_reason', sa.String(length=16), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=True),
    sa.Column('draft_steps', sa.Integer(), nullable=True),
    sa.Column('proposed', sa.Integer(), nullable=True),
    sa.Column('accepted', sa.Integer(), nullable=True),
    sa.Column('accepted_by_position', sa.JSON(), nullable=True),
    sa.Column('target_passes', sa.Integer(), nullable=True),
    sa.Column('new_tokens', sa.Integer(), nullable=True),
    sa.Column('draft_time', sa.Float(), nullable=True),
    sa.Column('verify_time', sa.Float(), nullable=True),
    sa.Column('worker', sa.String(length=255), nullable=True),
    sa.Column('writes', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_items_job_id_jobs'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'index', name=op.f('pk_items')),
    sa.UniqueConstraint('job_id', 'custom_id', name=op.f('uq_items_job_id_custom_id'))
    )
    op.create_index('ix_items_job_id_status', 'items', ['job_id', 'status'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_items_job_id_status', table_name='items')
    op.drop_table('items')
    op.drop_table('jobs')
