"""Tenants' storage grants (the roots an admin allows a tenant beyond its default).

Revision ID: 0005_tenant_storage
Revises: 0004_resize
Create Date: 2026-11-28
"""

from __future__ import annotations

revision = "0005_tenant_storage"
down_revision = "0004_resize"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
