"""Resizing running elastic jobs (the size and placement a job is relaunched at), and the
scheduler's counters kept in the store.

Revision ID: 0004_resize
Revises: 0003_scheduling
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_resize"
down_revision = "0003_scheduling"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("resize_to", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("resize_placement", sa.JSON(), nullable=True))
    op.create_table(
        "scheduler_stats",
        sa.Column("key", sa.String(32), primary_key=True),
        sa.Column("stats", sa.JSON(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("scheduler_stats")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("resize_placement")
        batch.drop_column("resize_to")
