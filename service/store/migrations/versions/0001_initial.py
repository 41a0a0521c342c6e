"""The first schema: tokens, jobs, job events, per-iteration metrics, checkpoints.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.UniqueConstraint("secret_hash", name="uq_tokens_secret_hash"),
    )
    op.create_index("ix_tokens_tenant", "tokens", ["tenant"])
    op.create_table(
        "jobs",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(96), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("request_hash", sa.String(64), nullable=True),
        sa.Column("submission_id", sa.String(160), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("launched_at", sa.Float(), nullable=True),
        sa.Column("launch_failures", sa.Integer(), nullable=False),
        sa.Column("telemetry_token_hash", sa.String(64), nullable=True),
        sa.Column("cancel_requested_at", sa.Float(), nullable=True),
        sa.Column("stop_sent_at", sa.Float(), nullable=True),
        sa.Column("train_iters", sa.Integer(), nullable=False),
        sa.Column("current_iteration", sa.Integer(), nullable=True),
        sa.Column("iteration_epoch", sa.Integer(), nullable=False),
        sa.Column("last_record", sa.JSON(), nullable=True),
        sa.Column("last_progress_at", sa.Float(), nullable=True),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("latest_checkpoint", sa.JSON(), nullable=True),
        sa.Column("failure_cause", sa.Text(), nullable=True),
        sa.Column("stats", sa.JSON(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.UniqueConstraint("id", name="uq_jobs_id"),
        sa.UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
    )
    op.create_index("ix_jobs_tenant", "jobs", ["tenant"])
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])
    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(96), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("recorded_at", sa.Float(), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("iteration", sa.Integer(), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("dedup_key", sa.String(64), nullable=True),
        sa.UniqueConstraint("job_id", "dedup_key", name="uq_job_events_dedup"),
    )
    op.create_index("ix_job_events_job_id", "job_events", ["job_id"])
    op.create_table(
        "job_metrics",
        sa.Column("job_id", sa.String(96), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("iteration", sa.Integer(), primary_key=True),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("recorded_at", sa.Float(), nullable=False),
        sa.Column("record", sa.JSON(), nullable=False),
    )
    op.create_table(
        "job_checkpoints",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(96), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("iteration", sa.Integer(), nullable=True),
        sa.Column("uri", sa.Text(), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("result", sa.String(16), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
    )
    op.create_index("ix_job_checkpoints_job_id", "job_checkpoints", ["job_id"])


def downgrade() -> None:
    op.drop_table("job_checkpoints")
    op.drop_table("job_metrics")
    op.drop_table("job_events")
    op.drop_table("jobs")
    op.drop_table("tokens")
