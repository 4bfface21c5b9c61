"""Exact cost units: the ledger's cost becomes numeric with six decimals (micro cost units), so that sums
over any range and grouping agree to the last digit. Existing costs are rounded to the microunit.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE usage_events ALTER COLUMN cost TYPE numeric(24, 6) USING round(cost::numeric, 6)")


def downgrade() -> None:
    op.execute("ALTER TABLE usage_events ALTER COLUMN cost TYPE double precision")
