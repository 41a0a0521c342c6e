"""Checkpoint exports (POST /v1/jobs/{id}/checkpoints/{iteration}/export).

Revision ID: 0002_job_exports
Revises: 0001_initial
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_job_exports"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_exports",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("job_id", sa.String(96), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("iteration", sa.Integer(), nullable=False),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("dtype", sa.String(8), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("output", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("submission_id", sa.String(200), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("submitted_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_job_exports_job_id", "job_exports", ["job_id"])
    op.create_index("ix_job_exports_status", "job_exports", ["status"])


def downgrade() -> None:
    op.drop_table("job_exports")
