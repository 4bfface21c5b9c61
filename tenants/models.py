"""The schema as SQLAlchemy Core tables (the migrations in ``migrations/versions`` create it).

Durations are seconds, costs are cost units (docs/architecture.md, "The cost unit"), times are UTC.
A NULL quota limit means unlimited.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

TENANT_STATUSES = ("active", "suspended")
# "deadline": a queued request refused unstarted once its TTFT target plus the grace had passed
SHED_REASONS = ("rate", "concurrency", "budget", "queue", "slo", "kv", "deadline")

tenants = sa.Table(
    "tenants",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("name", sa.Text, nullable=False, unique=True),
    sa.Column("weight", sa.Float, nullable=False, server_default="1"),
    sa.Column("status", sa.Text, nullable=False, server_default="active"),
    sa.Column("ttft_target_s", sa.Float, nullable=False, server_default="2"),
    sa.Column("tpot_target_s", sa.Float, nullable=False, server_default="0.2"),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.CheckConstraint("weight > 0", name="tenants_weight_positive"),
    sa.CheckConstraint("status IN ('active', 'suspended')", name="tenants_status_valid"),
    sa.CheckConstraint("ttft_target_s > 0 AND tpot_target_s > 0", name="tenants_targets_positive"),
)

quotas = sa.Table(
    "quotas",
    metadata,
    sa.Column("tenant_id", sa.BigInteger, sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("cost_per_minute", sa.Float),
    sa.Column("max_concurrency", sa.Integer),
    sa.Column("monthly_budget", sa.Float),
    sa.Column("max_output_tokens", sa.Integer),
    sa.CheckConstraint("cost_per_minute > 0", name="quotas_rate_positive"),
    sa.CheckConstraint("max_concurrency > 0", name="quotas_concurrency_positive"),
    sa.CheckConstraint("monthly_budget >= 0", name="quotas_budget_non_negative"),
    sa.CheckConstraint("max_output_tokens > 0", name="quotas_output_positive"),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("tenant_id", sa.BigInteger, sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    sa.Column("prefix", sa.Text, nullable=False),
    sa.Column("key_hash", sa.LargeBinary, nullable=False, unique=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.Column("revoked_at", sa.DateTime(timezone=True)),
    sa.Column("last_used_at", sa.DateTime(timezone=True)),
    sa.Index("api_keys_tenant", "tenant_id"),
)

# Live quota state: one row per tenant (token bucket, in-flight count, month's spend including slices
# held by processes), and one lease row per (tenant, process) for the slice that process holds.
quota_state = sa.Table(
    "quota_state",
    metadata,
    sa.Column("tenant_id", sa.BigInteger, sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("bucket_level", sa.Float, nullable=False, server_default="0"),
    sa.Column("bucket_updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.Column("in_flight", sa.Integer, nullable=False, server_default="0"),
    sa.Column("period_start", sa.Date, nullable=False),
    sa.Column("period_spent", sa.Float, nullable=False, server_default="0"),
)

quota_leases = sa.Table(
    "quota_leases",
    metadata,
    sa.Column("tenant_id", sa.BigInteger, sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("holder", sa.Text, primary_key=True),
    sa.Column("held_cost", sa.Float, nullable=False, server_default="0"),
    sa.Column("held_slots", sa.Integer, nullable=False, server_default="0"),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
)

# The ledger is append-only and keyed for idempotent replay; it has no foreign keys so that one bad event
# can never block a batch.
usage_events = sa.Table(
    "usage_events",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.BigInteger, nullable=False),
    sa.Column("key_id", sa.BigInteger),
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("cached_tokens", sa.Integer, nullable=False),
    sa.Column("output_tokens", sa.Integer, nullable=False),
    sa.Column("cost", sa.Numeric(24, 6), nullable=False),  # exact: micro cost units
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("finish_reason", sa.Text),
    sa.Column("queue_s", sa.Float),
    sa.Column("ttft_s", sa.Float),
    sa.Column("tpot_s", sa.Float),
    sa.Column("e2e_s", sa.Float),
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("usage_events_tenant_finished", "tenant_id", "finished_at"),
    sa.Index("usage_events_finished", "finished_at"),
    sa.Index("usage_events_key_finished", "key_id", "finished_at"),
)

shed_events = sa.Table(
    "shed_events",
    metadata,
    sa.Column("event_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.BigInteger, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("shed_events_tenant_at", "tenant_id", "at"),
    sa.Index("shed_events_at", "at"),
)

# Rollups (tenants/rollups.py): usage per granularity ("hour" | "day"), UTC period, tenant, key and model;
# refusals per tenant and reason; latency histograms per tenant, metric ("ttft" | "tpot") and fixed bucket.
usage_rollups = sa.Table(
    "usage_rollups",
    metadata,
    sa.Column("granularity", sa.Text, nullable=False),
    sa.Column("period_start", sa.DateTime(timezone=True), nullable=False),
    sa.Column("tenant_id", sa.BigInteger, nullable=False),
    sa.Column("key_id", sa.BigInteger),
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("requests", sa.BigInteger, nullable=False),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
    sa.Column("cached_tokens", sa.BigInteger, nullable=False),
    sa.Column("output_tokens", sa.BigInteger, nullable=False),
    sa.Column("cost", sa.Numeric, nullable=False),
    sa.Column("slo_met", sa.BigInteger, nullable=False),
    sa.Index("usage_rollups_period", "granularity", "period_start"),
)

shed_rollups = sa.Table(
    "shed_rollups",
    metadata,
    sa.Column("granularity", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.BigInteger, primary_key=True),
    sa.Column("period_start", sa.DateTime(timezone=True), primary_key=True),
    sa.Column("reason", sa.Text, primary_key=True),
    sa.Column("refusals", sa.BigInteger, nullable=False),
    sa.Index("shed_rollups_period", "granularity", "period_start"),
)

latency_rollups = sa.Table(
    "latency_rollups",
    metadata,
    sa.Column("granularity", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.BigInteger, primary_key=True),
    sa.Column("period_start", sa.DateTime(timezone=True), primary_key=True),
    sa.Column("metric", sa.Text, primary_key=True),
    sa.Column("bucket", sa.SmallInteger, primary_key=True),
    sa.Column("requests", sa.BigInteger, nullable=False),
    sa.Index("latency_rollups_period", "granularity", "period_start"),
)

# Hours whose rollups are stale: inserted by triggers on both ledgers, consumed by refresh_rollups.
rollup_marks = sa.Table(
    "rollup_marks",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
    sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
)
