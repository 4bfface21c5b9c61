"""Quota slices shrink as a limit nears: a grant's extra is at most a tenth of what remains of each limit
(it was a tenth of the limit), so processes hold little of the last part of a budget, bucket or
concurrency limit and refuse others less while they hold it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

OLD_CAPS = """
        got_cost := p_need_cost + greatest(0, least(p_extra_cost, free_budget - p_need_cost,
            free_rate - p_need_cost, coalesce(q.cost_per_minute / 10, 'Infinity'),
            coalesce(q.monthly_budget / 10, 'Infinity')));
        got_slots := p_need_slots + greatest(0, least(p_extra_slots::double precision,
            free_slots - p_need_slots,
            coalesce((q.max_concurrency / 10)::double precision, 'Infinity')))::integer;
"""
NEW_CAPS = """
        got_cost := p_need_cost + greatest(0, least(p_extra_cost, (free_budget - p_need_cost) / 10,
            (free_rate - p_need_cost) / 10));
        got_slots := p_need_slots + greatest(0, least(p_extra_slots::double precision,
            floor((free_slots - p_need_slots) / 10)))::integer;
"""


def _initial() -> ModuleType:
    """Revision 0001, whose function text this revision edits (and restores on downgrade)."""
    path = Path(__file__).with_name("0001_tenants_quotas_ledger.py")
    spec = importlib.util.spec_from_file_location("weir_revision_0001", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _acquire(caps: str) -> str:
    text = _initial().ACQUIRE
    assert OLD_CAPS in text, "revision 0001's weir_quota_acquire changed"
    return text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1).replace(OLD_CAPS, caps)


def upgrade() -> None:
    op.execute(_acquire(NEW_CAPS))


def downgrade() -> None:
    op.execute(_acquire(OLD_CAPS))
