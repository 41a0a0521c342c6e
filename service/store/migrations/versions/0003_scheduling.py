"""Scheduling: the scheduler's fields on jobs, and tenant quotas.

Revision ID: 0003_scheduling
Revises: 0002_job_exports
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_scheduling"
down_revision = "0002_job_exports"
branch_labels = None
depends_on = None

def _job_columns() -> list[sa.Column]:
    return [
        sa.Column("priority", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("preemptible", sa.Boolean(), nullable=False, server_default=sa.true()),
        sa.Column("demand", sa.JSON(), nullable=True),
        sa.Column("queued_at", sa.Float(), nullable=True),
        sa.Column("waited_s", sa.Float(), nullable=False, server_default=sa.text("0")),
        sa.Column("queue_position", sa.Integer(), nullable=True),
        sa.Column("waiting_reason", sa.Text(), nullable=True),
        sa.Column("placement", sa.JSON(), nullable=True),
        sa.Column("backfilled_for", sa.String(96), nullable=True),
        sa.Column("yields_to", sa.String(96), nullable=True),
        sa.Column("preempt_requested_at", sa.Float(), nullable=True),
        sa.Column("preempt_reason", sa.Text(), nullable=True),
    ]


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for column in _job_columns():
            batch.add_column(column)
    op.create_table(
        "tenant_quotas",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("ranks", sa.Integer(), nullable=True),
        sa.Column("gpus", sa.Float(), nullable=True),
        sa.Column("cpus", sa.Float(), nullable=True),
        sa.Column("queued", sa.Integer(), nullable=True),
        sa.Column("max_priority", sa.Integer(), nullable=True),
        sa.Column("allow_non_preemptible", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("tenant_quotas")
    with op.batch_alter_table("jobs") as batch:
        for column in reversed(_job_columns()):
            batch.drop_column(column.name)
