"""Hourly and daily rollups: usage per tenant, key and model, refusals per tenant and reason, latency
histograms (fixed buckets) per tenant. Inserts into the ledgers mark their hours for
``tenants.rollups.refresh_rollups``, which recomputes marked hours (and their days) from the raw rows.
Every hour already in the ledgers is marked here, so the first refresh builds the rollups of existing data.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

BUCKETS = 74  # tenants/rollups.py: LATENCY_BUCKETS

STATEMENTS = [
    f"""
CREATE FUNCTION weir_latency_bucket(v double precision) RETURNS smallint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN v < 0.001 THEN 0
                ELSE least({BUCKETS - 1}, 1 + floor(4 * ln(v / 0.001) / ln(2))::integer) END::smallint
$$""",
    """
CREATE TABLE usage_rollups (
    granularity text NOT NULL,
    period_start timestamptz NOT NULL,
    tenant_id bigint NOT NULL,
    key_id bigint,
    model text NOT NULL,
    requests bigint NOT NULL,
    prompt_tokens bigint NOT NULL,
    cached_tokens bigint NOT NULL,
    output_tokens bigint NOT NULL,
    cost numeric NOT NULL,
    slo_met bigint NOT NULL,
    CONSTRAINT usage_rollups_granularity CHECK (granularity IN ('hour', 'day')),
    CONSTRAINT usage_rollups_unique UNIQUE NULLS NOT DISTINCT
        (granularity, tenant_id, period_start, key_id, model)
)""",
    "CREATE INDEX usage_rollups_period ON usage_rollups (granularity, period_start)",
    """
CREATE TABLE shed_rollups (
    granularity text NOT NULL,
    period_start timestamptz NOT NULL,
    tenant_id bigint NOT NULL,
    reason text NOT NULL,
    refusals bigint NOT NULL,
    PRIMARY KEY (granularity, tenant_id, period_start, reason),
    CONSTRAINT shed_rollups_granularity CHECK (granularity IN ('hour', 'day'))
)""",
    "CREATE INDEX shed_rollups_period ON shed_rollups (granularity, period_start)",
    """
CREATE TABLE latency_rollups (
    granularity text NOT NULL,
    period_start timestamptz NOT NULL,
    tenant_id bigint NOT NULL,
    metric text NOT NULL,
    bucket smallint NOT NULL,
    requests bigint NOT NULL,
    PRIMARY KEY (granularity, tenant_id, period_start, metric, bucket),
    CONSTRAINT latency_rollups_granularity CHECK (granularity IN ('hour', 'day'))
)""",
    "CREATE INDEX latency_rollups_period ON latency_rollups (granularity, period_start)",
    """
CREATE TABLE rollup_marks (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    hour timestamptz NOT NULL
)""",
    """
CREATE FUNCTION weir_mark_rollup_hours() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('INSERT INTO rollup_marks (hour) SELECT DISTINCT date_trunc(''hour'', %I, ''UTC'') '
                   'FROM new_rows', TG_ARGV[0]);
    RETURN NULL;
END
$$""",
    """
CREATE TRIGGER usage_events_mark_rollups AFTER INSERT ON usage_events REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION weir_mark_rollup_hours('finished_at')""",
    """
CREATE TRIGGER shed_events_mark_rollups AFTER INSERT ON shed_events REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION weir_mark_rollup_hours('at')""",
    """
INSERT INTO rollup_marks (hour)
SELECT date_trunc('hour', finished_at, 'UTC') FROM usage_events
UNION SELECT date_trunc('hour', at, 'UTC') FROM shed_events""",
    "CREATE INDEX usage_events_key_finished ON usage_events (key_id, finished_at)",
]


def upgrade() -> None:
    for statement in STATEMENTS:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP INDEX usage_events_key_finished")
    op.execute("DROP TRIGGER shed_events_mark_rollups ON shed_events")
    op.execute("DROP TRIGGER usage_events_mark_rollups ON usage_events")
    op.execute("DROP FUNCTION weir_mark_rollup_hours()")
    op.execute("DROP TABLE rollup_marks, latency_rollups, shed_rollups, usage_rollups")
    op.execute("DROP FUNCTION weir_latency_bucket(double precision)")
