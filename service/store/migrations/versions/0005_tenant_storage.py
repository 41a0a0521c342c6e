"""Tenants' storage grants (the roots an admin allows a tenant beyond its default), and the
roots each job was admitted with (handed to its workers at every launch).

Revision ID: 0005_tenant_storage
Revises: 0004_resize
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_tenant_storage"
down_revision = "0004_resize"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenant_storage",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("roots", sa.JSON(), nullable=False),
        sa.Column("read_roots", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "job_storage",
        sa.Column("job_id", sa.String(96), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("roots", sa.JSON(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("job_storage")
    op.drop_table("tenant_storage")
