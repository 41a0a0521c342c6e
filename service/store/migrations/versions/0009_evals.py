"""Evaluations: `job_evals`, one lm-eval run (`elastron eval`) on a job's committed checkpoint,
its tasks and options, status and the scores it reported.

Revision ID: 0009_evals
Revises: 0008_sweeps
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_evals"
down_revision = "0008_sweeps"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_evals",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("job_id", sa.String(96), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("iteration", sa.Integer(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("tasks", sa.JSON(), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("results", sa.JSON(), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("submission_id", sa.String(200), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("submitted_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_job_evals_job_id", "job_evals", ["job_id"])
    op.create_index("ix_job_evals_status", "job_evals", ["status"])


def downgrade() -> None:
    op.drop_table("job_evals")
