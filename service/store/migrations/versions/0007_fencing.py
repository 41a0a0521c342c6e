"""Fencing tokens: each job attempt carries one; telemetry from a stale attempt is refused.

`jobs.fencing_token` is the current attempt's token (it only grows, one per launch);
`attempt_fences` keeps the attempts a job has left behind (their token hash, to tell a stale
attempt's telemetry from a forged one, and their submission id, to stop a late-landing orphan).

Revision ID: 0007_fencing
Revises: 0006_request_limits
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_fencing"
down_revision = "0006_request_limits"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("fencing_token", sa.Integer(), nullable=False, server_default=sa.text("0")))
    op.create_table(
        "attempt_fences",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(96), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("fencing_token", sa.Integer(), nullable=False),
        sa.Column("submission_id", sa.String(160), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=True),
        sa.Column("retired_at", sa.Float(), nullable=False),
        sa.Column("watch_until", sa.Float(), nullable=True),
        sa.Column("stopped_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_attempt_fences_job_id", "attempt_fences", ["job_id"])
    op.create_index("ix_attempt_fences_token_hash", "attempt_fences", ["token_hash"])
    op.create_index("ix_attempt_fences_watch_until", "attempt_fences", ["watch_until"])


def downgrade() -> None:
    op.drop_index("ix_attempt_fences_watch_until", table_name="attempt_fences")
    op.drop_index("ix_attempt_fences_token_hash", table_name="attempt_fences")
    op.drop_index("ix_attempt_fences_job_id", table_name="attempt_fences")
    op.drop_table("attempt_fences")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("fencing_token")
