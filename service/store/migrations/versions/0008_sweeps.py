"""Sweeps: `sweeps` (what was submitted, its state, spend and best trial), `sweep_trials` (each
trial's Optuna number, values, job and outcome), and `jobs.pruned_at` (a trial its sweep's pruner
stopped: cancelled once it saved its step, not requeued).

Revision ID: 0008_sweeps
Revises: 0007_fencing
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_sweeps"
down_revision = "0007_fencing"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("pruned_at", sa.Float(), nullable=True))
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(96), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("cancel_requested_at", sa.Float(), nullable=True),
        sa.Column("trials_started", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("gpu_seconds", sa.Float(), nullable=False, server_default=sa.text("0")),
        sa.Column("best", sa.JSON(), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("pending_resumes", sa.JSON(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
    )
    op.create_index("ix_sweeps_tenant", "sweeps", ["tenant"])
    op.create_index("ix_sweeps_state", "sweeps", ["state"])
    op.create_table(
        "sweep_trials",
        sa.Column("sweep_id", sa.String(96), sa.ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("number", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.String(96), nullable=True),
        sa.Column("resumes_job", sa.String(96), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("reported_iteration", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
    )
    op.create_index("ix_sweep_trials_job_id", "sweep_trials", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_sweep_trials_job_id", table_name="sweep_trials")
    op.drop_table("sweep_trials")
    op.drop_index("ix_sweeps_state", table_name="sweeps")
    op.drop_index("ix_sweeps_tenant", table_name="sweeps")
    op.drop_table("sweeps")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("pruned_at")
