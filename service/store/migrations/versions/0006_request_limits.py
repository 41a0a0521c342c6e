"""Request limits that hold across API replicas (rate-limit buckets in the store).

Revision ID: 0006_request_limits
Revises: 0005_tenant_storage
Create Date: 2026-11-28
"""

from __future__ import annotations

revision = "0006_request_limits"
down_revision = "0005_tenant_storage"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
