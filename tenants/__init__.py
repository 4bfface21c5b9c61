"""Tenants, API keys, quotas and the usage ledger in PostgreSQL (SQLAlchemy 2 async + asyncpg).

``tenants`` knows nothing of the engine: costs arrive as plain numbers in cost units (``api`` computes
them with ``engine/cost.py``). Every database function takes an ``AsyncEngine`` from ``tenants.db``.

Public API (stable; import from the submodules):

``tenants.db``
    ``database_url() -> str`` (``DATABASE_URL``, else the embedded server under ``<WEIR_STATE_DIR>/postgres``,
    started if needed and left running for the next command), ``create_engine(url=None) -> AsyncEngine``,
    ``upgrade_to_head(url)``, ``downgrade(url, revision="base")`` (both callable from sync or async code;
    they block; concurrent upgrades wait for each other), ``embedded_server() -> EmbeddedPostgres``
    (``.start() -> url``, ``.stop()``, ``.running_url()``, ``.remove()``; as root its programs and cluster
    live under ``/var/lib/weir``, see ``tenants.pg_runtime``), ``state_dir()``, ``with_database(url, name)``,
    ``DatabaseError``.
``tenants.records``
    ``Tenant`` (id, name, weight, status, ttft_target_s, tpot_target_s, quotas, created_at; ``.active``),
    ``Quotas`` (cost_per_minute, max_concurrency, monthly_budget, max_output_tokens; ``None`` = unlimited),
    ``ApiKey`` (id, tenant_id, prefix, created_at, revoked_at, last_used_at), and the admin errors
    ``TenantsError`` > ``NotFound`` / ``Conflict`` / ``InvalidValue`` (one-line messages).
``tenants.admin``
    ``create_tenant(engine, name, *, weight, ttft_target_s, tpot_target_s, quota: Quotas)``,
    ``get_tenant(engine, name_or_id)``, ``list_tenants(engine)``,
    ``update_tenant(engine, name_or_id, **changes)`` (weight, targets, quota fields; ``None`` = unlimited),
    ``set_tenant_status(engine, name_or_id, "active" | "suspended")``,
    ``create_key(engine, tenant) -> (ApiKey, secret)`` (the secret is shown once, never stored),
    ``list_keys(engine, tenant)``, ``revoke_key(engine, key_id)``.
``tenants.auth``
    ``KeyAuthenticator(engine, ttl_s=5.0)``: ``await authenticate(secret) -> Principal`` (key_id, key_prefix,
    tenant; ``.tenant_id``, ``.tenant_name``, ``.quotas``) or raises ``UnknownKey`` / ``RevokedKey`` /
    ``TenantSuspended`` (all ``AuthError`` with ``.reason``); results are cached for ``ttl_s``;
    ``await close()`` writes pending ``last_used_at``.
``tenants.quotas``
    ``QuotaManager(engine, lease_s=10.0, sync_interval_s=0.05)``, one per process:
    ``await reserve(tenant_id, worst_case_cost) -> Reservation | Refusal`` (Refusal: reason
    ``rate|concurrency|budget``, limit, remaining, retry_after_s (``None``: retrying cannot help), reset_s),
    ``settle(reservation, actual_cost) -> bool`` and ``release(reservation) -> bool`` (no I/O, idempotent),
    ``await sync()``, ``await close()``. Per-process leases of budget slices; bounds in the module docstring.
``tenants.usage``
    ``UsageEvent`` (request_id, tenant_id, key_id, model, prompt/cached/output tokens, cost, status,
    finish_reason, queue_s, ttft_s, tpot_s, e2e_s, started_at, finished_at), ``ShedEvent``;
    ``UsageWriter(engine, spill_dir=None)`` (default ``<WEIR_STATE_DIR>/spill``; use it from one event
    loop): ``submit(event)`` (never blocks or raises on an outage; ``ValueError`` for a malformed event),
    ``record_shed(tenant_id, reason)`` (rate, concurrency, budget, queue, slo, kv, deadline), ``start()``,
    ``await flush()``, ``await close()``, ``await replay_spill()``.
``tenants.queries``
    ``usage_by_day``, ``latency_percentiles``, ``shed_counts`` (engine, since, until=None, tenant_id=None).
``tenants.reporting`` (the dashboard's figures; reads rollups for whole hours and days)
    ``Window(since, until)``, ``overview(db, window, tenant_id=None) -> UsageFigures``,
    ``tenant_table(db, window) -> [TenantFigures]``, ``tenant_series(db, tenant_id, window, "hour"|"day")
    -> [SeriesPoint]``, ``ledger_page(db, LedgerFilter, before, limit) -> ([LedgerRow], cursor)``,
    ``ledger_entry(db, request_id) -> LedgerRow | None``.
``tenants.rollups``
    ``refresh_rollups(db)`` (recompute marked hours and their days), ``percentile(histogram, q)``.
``tenants.exports``
    ``export_rows(db, since, until, "request"|"hour"|"day", tenant_id=None) -> Export`` (``async for`` gives
    ``ExportRow``), ``csv_chunks(export)``, ``jsonl_chunks(export)``, ``focus_chunks(export, FocusSettings)``
    (async iterators of text), ``check_range``; docs/billing.md.
``tenants.traffic``
    ``fill(db, tenants, since, until, requests)``: synthetic usage for the demo and the benchmark.
``tenants.cli``
    ``register(subparsers)``: ``weir db upgrade|downgrade|stop|url``, ``weir tenant create|list|show|update|
    suspend|resume``, ``weir key create|list|revoke``, ``weir usage show|export``.

Test fixtures (``tests/fixtures/database.py``): ``pg_server_url`` (session: ``DATABASE_URL`` or a throwaway
embedded server), ``database_url`` (per test: a fresh database migrated to head; give it to a subprocess
as ``DATABASE_URL``), ``db_engine`` (per test: an engine on it).
"""
