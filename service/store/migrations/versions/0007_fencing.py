"""Fencing tokens: each job attempt carries one; telemetry from a stale attempt is refused.

Revision ID: 0007_fencing
Revises: 0006_request_limits
Create Date: 2026-11-28
"""

from __future__ import annotations

revision = "0007_fencing"
down_revision = "0006_request_limits"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
