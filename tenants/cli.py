"""``weir db``, ``weir tenant``, ``weir key`` and ``weir usage``: administration from the shell.

Heavy imports (SQLAlchemy, asyncpg, Alembic) happen inside the commands. Every user-facing failure is
one line on stderr and exit status 1.

Ids on the command line are ASCII digits only: ``str.isdigit`` (and ``int``) also take ``١`` or ``²``,
which would name another key or fail deep inside. A tenant is named by its name or its id (names are
never only digits). ``weir key revoke TENANT KEY_ID`` names the key's tenant and refuses a key of another.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from tenants.records import ApiKey, Tenant

_UNLIMITED = ("none", "unlimited")
_QUOTA_OPTIONS = (
    ("--cost-per-minute", "cost_per_minute", float, "cost units per minute (token bucket refill)"),
    ("--max-concurrency", "max_concurrency", int, "requests in flight at once"),
    ("--monthly-budget", "monthly_budget", float, "cost units per calendar month (UTC)"),
    ("--max-output-tokens", "max_output_tokens", int, "max_tokens allowed per request"),
)
_TENANT_OPTIONS = (
    ("--weight", "weight", float, "fair-share weight (default 1)"),
    ("--ttft-target", "ttft_target_s", float, "time-to-first-token target in seconds (default 2)"),
    ("--tpot-target", "tpot_target_s", float, "time-per-output-token target in seconds (default 0.2)"),
)


def _fail(command: str, message: object) -> SystemExit:
    text = " ".join(str(message).split()) or "failed"
    return SystemExit(f"weir {command}: error: {text}")


def _id(command: str, what: str, raw: str) -> int:
    """An id given on the command line: ASCII digits, below 2**63."""
    if not (raw.isascii() and raw.isdigit()) or int(raw) >= 2**63:
        raise _fail(command, f"{what} must be an id in ASCII digits (0-9), got {raw!r}")
    return int(raw)


def _tenant_ref(command: str, raw: str) -> str | int:
    """A tenant's id when ``raw`` is all digits (of any script: only ASCII ones pass), else its name."""
    return _id(command, "TENANT", raw) if raw.isdigit() else raw


def _number(command: str, option: str, raw: str, kind: type) -> float | int | None:
    if raw.strip().lower() in _UNLIMITED:
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise _fail(
            command, f"{option}: expected {'a whole number' if kind is int else 'a number'}, got {raw!r}"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise _fail(command, f"{option}: must be a finite number >= 0, got {raw!r}")
    return value


def _options(command: str, args: argparse.Namespace, table: Sequence[tuple[str, str, type, str]]) -> dict:
    """The options given on the command line, converted (``none``/``unlimited`` -> ``None``)."""
    return {
        dest: _number(command, flag, getattr(args, dest), kind)
        for flag, dest, kind, _ in table
        if getattr(args, dest) is not None
    }


def _run(command: str, body: Callable[[AsyncEngine], Awaitable[int | None]]) -> int:
    """Run ``body`` with an engine on the configured database, turning failures into one-line errors."""
    from sqlalchemy.exc import DBAPIError, SQLAlchemyError

    from tenants.db import DatabaseError, create_engine
    from tenants.records import TenantsError

    async def main() -> int | None:
        engine = create_engine()
        try:
            return await body(engine)
        finally:
            await engine.dispose()

    try:
        return int(asyncio.run(main()) or 0)
    except (TenantsError, DatabaseError) as exc:
        raise _fail(command, exc) from None
    except DBAPIError as exc:
        detail = str(exc.orig).splitlines()[-1] if exc.orig is not None else str(exc)
        if "does not exist" in detail and ("relation" in detail or "function" in detail):
            detail = "the database schema is missing or outdated; run `weir db upgrade`"
        raise _fail(command, f"database: {detail}") from None
    except (SQLAlchemyError, OSError) as exc:
        raise _fail(command, f"database unreachable: {exc}") from None


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(headers)] + [["-" if v is None else _cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, Decimal):  # exact cost units, without trailing zeros
        return format(value.normalize(), "f")
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


def _tenant_rows(tenants: Sequence[Tenant]) -> str:
    headers = (
        "ID",
        "NAME",
        "STATUS",
        "WEIGHT",
        "COST/MIN",
        "CONCURRENCY",
        "MONTHLY BUDGET",
        "MAX OUTPUT",
        "TTFT S",
        "TPOT S",
    )
    return _table(
        headers,
        [
            (
                t.id,
                t.name,
                t.status,
                t.weight,
                t.quotas.cost_per_minute,
                t.quotas.max_concurrency,
                t.quotas.monthly_budget,
                t.quotas.max_output_tokens,
                t.ttft_target_s,
                t.tpot_target_s,
            )
            for t in tenants
        ],
    )


def _key_rows(keys: Sequence[ApiKey]) -> str:
    return _table(
        ("KEY ID", "PREFIX", "CREATED", "REVOKED", "LAST USED"),
        [(k.id, k.prefix + "...", k.created_at, k.revoked_at, k.last_used_at) for k in keys],
    )


# --- weir db ---


def _migrate(command: str, revision: str | None) -> int:
    """Upgrade to head (``revision`` None) or downgrade to ``revision``, then say where the schema is."""
    import sqlalchemy as sa

    from tenants.db import database_url, downgrade, upgrade_to_head

    try:
        url = database_url()
        if revision is None:
            upgrade_to_head(url)
        else:
            downgrade(url, revision)
    except Exception as exc:  # DatabaseError, Alembic (unknown revision) and driver errors: one line
        raise _fail(command, exc) from None

    async def body(engine: AsyncEngine) -> int:
        async with engine.connect() as conn:
            current = (await conn.execute(sa.text("SELECT version_num FROM alembic_version"))).scalar()
        print(f"database schema at revision {current}" if current else "database schema is empty")
        return 0

    return _run(command, body)


def _db_upgrade(args: argparse.Namespace) -> int:
    return _migrate("db upgrade", None)


def _db_downgrade(args: argparse.Namespace) -> int:
    return _migrate("db downgrade", args.revision)


def _db_stop(args: argparse.Namespace) -> int:
    import os

    from tenants.db import DATABASE_URL_ENV, DatabaseError, embedded_server

    if os.environ.get(DATABASE_URL_ENV):
        print(f"note: {DATABASE_URL_ENV} is set; Weir does not use its embedded PostgreSQL", file=sys.stderr)
    try:
        stopped = embedded_server().stop()
    except DatabaseError as exc:
        raise _fail("db stop", exc) from None
    print("embedded PostgreSQL stopped" if stopped else "embedded PostgreSQL was not running")
    return 0


def _db_url(args: argparse.Namespace) -> int:
    from tenants.db import DatabaseError, database_url

    try:
        print(database_url())
    except DatabaseError as exc:
        raise _fail("db url", exc) from None
    return 0


# --- weir tenant ---


def _tenant_create(args: argparse.Namespace) -> int:
    from tenants.admin import create_tenant
    from tenants.records import Quotas

    quota = _options("tenant create", args, _QUOTA_OPTIONS)
    settings = _options("tenant create", args, _TENANT_OPTIONS)

    async def body(engine: AsyncEngine) -> int:
        tenant = await create_tenant(engine, args.name, quota=Quotas(**quota), **settings)
        print(_tenant_rows([tenant]))
        return 0

    return _run("tenant create", body)


def _tenant_list(args: argparse.Namespace) -> int:
    from tenants.admin import list_tenants

    async def body(engine: AsyncEngine) -> int:
        tenants = await list_tenants(engine)
        print(_tenant_rows(tenants) if tenants else "no tenants")
        return 0

    return _run("tenant list", body)


def _tenant_show(args: argparse.Namespace) -> int:
    from tenants.admin import get_tenant, list_keys

    ref = _tenant_ref("tenant show", args.name)

    async def body(engine: AsyncEngine) -> int:
        tenant = await get_tenant(engine, ref)
        keys = await list_keys(engine, tenant.id)
        print(_tenant_rows([tenant]))
        print()
        print(_key_rows(keys) if keys else "no keys")
        return 0

    return _run("tenant show", body)


def _tenant_update(args: argparse.Namespace) -> int:
    from tenants.admin import update_tenant

    ref = _tenant_ref("tenant update", args.name)
    changes = {
        **_options("tenant update", args, _QUOTA_OPTIONS),
        **_options("tenant update", args, _TENANT_OPTIONS),
    }
    if not changes:
        raise _fail("tenant update", "nothing to change (give at least one option)")

    async def body(engine: AsyncEngine) -> int:
        print(_tenant_rows([await update_tenant(engine, ref, **changes)]))
        return 0

    return _run("tenant update", body)


def _tenant_status(status: str) -> Callable[[argparse.Namespace], int]:
    command = "tenant suspend" if status == "suspended" else "tenant resume"

    def handler(args: argparse.Namespace) -> int:
        from tenants.admin import set_tenant_status

        ref = _tenant_ref(command, args.name)

        async def body(engine: AsyncEngine) -> int:
            tenant = await set_tenant_status(engine, ref, status)
            print(f"tenant {tenant.name} is {tenant.status}")
            return 0

        return _run(command, body)

    return handler


# --- weir key ---


def _key_create(args: argparse.Namespace) -> int:
    from tenants.admin import create_key

    ref = _tenant_ref("key create", args.tenant)

    async def body(engine: AsyncEngine) -> int:
        key, secret = await create_key(engine, ref)
        print(secret)
        print(
            f"key id {key.id} for tenant {args.tenant}: store the key now, it is not shown again",
            file=sys.stderr,
        )
        return 0

    return _run("key create", body)


def _key_list(args: argparse.Namespace) -> int:
    from tenants.admin import list_keys

    ref = _tenant_ref("key list", args.tenant)

    async def body(engine: AsyncEngine) -> int:
        keys = await list_keys(engine, ref)
        print(_key_rows(keys) if keys else "no keys")
        return 0

    return _run("key list", body)


def _key_revoke(args: argparse.Namespace) -> int:
    from tenants.admin import get_tenant, list_keys, revoke_key
    from tenants.records import NotFound

    ref = _tenant_ref("key revoke", args.tenant)
    key_id = _id("key revoke", "KEY_ID", args.key_id)

    async def body(engine: AsyncEngine) -> int:
        tenant = await get_tenant(engine, ref)
        if key_id not in {key.id for key in await list_keys(engine, tenant.id)}:  # a key never changes tenant
            raise NotFound(f"tenant {tenant.name} has no key with id {key_id}")
        key = await revoke_key(engine, key_id)
        print(f"key {key.id} ({key.prefix}...) of tenant {tenant.name} revoked")
        return 0

    return _run("key revoke", body)


# --- weir usage ---


def _moment(command: str, option: str, raw: str) -> datetime:
    try:
        parsed = (
            datetime.fromisoformat(raw)
            if "T" in raw or " " in raw
            else datetime.combine(date.fromisoformat(raw), datetime.min.time())
        )
    except ValueError:
        raise _fail(command, f"{option}: expected a date like 2026-01-31, got {raw!r}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _usage_show(args: argparse.Namespace) -> int:
    from tenants.admin import get_tenant
    from tenants.queries import latency_percentiles, shed_counts, usage_by_day

    now = datetime.now(UTC)
    since = _moment("usage show", "--since", args.since) if args.since else now - timedelta(days=30)
    until = _moment("usage show", "--until", args.until) if args.until else None
    ref = _tenant_ref("usage show", args.tenant) if args.tenant else None
    if until is not None and until <= since:
        raise _fail("usage show", "--until must be after --since")

    async def body(engine: AsyncEngine) -> int:
        tenant_id = (await get_tenant(engine, ref)).id if ref is not None else None
        usage = await usage_by_day(engine, since, until, tenant_id)
        latency = await latency_percentiles(engine, since, until, tenant_id)
        shed = await shed_counts(engine, since, until, tenant_id)
        print(f"usage since {_cell(since)} UTC")
        print(
            _table(
                ("DAY", "TENANT", "MODEL", "REQUESTS", "ERRORS", "PROMPT", "CACHED", "OUTPUT", "COST"),
                [
                    (
                        u.day,
                        u.tenant_name,
                        u.model,
                        u.requests,
                        u.errors,
                        u.prompt_tokens,
                        u.cached_tokens,
                        u.output_tokens,
                        u.cost,
                    )
                    for u in usage
                ],
            )
            if usage
            else "no usage"
        )
        if latency:
            print()
            print(
                _table(
                    ("TENANT", "REQUESTS", "TTFT P50", "TTFT P99", "TPOT P50", "TPOT P99"),
                    [
                        (s.tenant_name, s.requests, s.ttft_p50, s.ttft_p99, s.tpot_p50, s.tpot_p99)
                        for s in latency
                    ],
                )
            )
        if shed:
            print()
            rows = [(s.tenant_name, s.reason, s.count) for s in shed]
            print(_table(("TENANT", "SHED REASON", "COUNT"), rows))
        return 0

    return _run("usage show", body)


def _usage_export(args: argparse.Namespace) -> int:
    from tenants.admin import get_tenant
    from tenants.exports import (
        FocusSettings,
        check_range,
        csv_chunks,
        export_rows,
        focus_chunks,
        jsonl_chunks,
    )
    from tenants.records import TenantsError

    command = "usage export"
    since = _moment(command, "--since", args.since)
    until = _moment(command, "--until", args.until)
    ref = _tenant_ref(command, args.tenant) if args.tenant else None
    try:
        check_range(since, until, args.granularity)
        settings = FocusSettings.from_env(args.price) if args.format == "focus" else None
    except TenantsError as exc:
        raise _fail(command, exc) from None

    async def body(engine: AsyncEngine) -> int:
        tenant_id = (await get_tenant(engine, ref)).id if ref is not None else None
        rows = export_rows(engine, since, until, args.granularity, tenant_id)
        if settings is not None:
            chunks = focus_chunks(rows, settings)
        else:
            chunks = csv_chunks(rows) if args.format == "csv" else jsonl_chunks(rows)
        if not args.out:
            async for chunk in chunks:
                sys.stdout.write(chunk)
            sys.stdout.flush()
            return 0
        partial = Path(f"{args.out}.part")  # the file appears whole or not at all
        try:
            out = partial.open("w", newline="", encoding="utf-8")
        except OSError as exc:
            raise _fail(command, f"--out: {exc}") from None
        try:
            with out:
                async for chunk in chunks:
                    out.write(chunk)
            partial.replace(args.out)
        except OSError as exc:
            if isinstance(exc, ConnectionError | TimeoutError):
                raise
            raise _fail(command, f"--out: {exc}") from None
        finally:
            partial.unlink(missing_ok=True)
        return 0

    return _run(command, body)


# --- registration ---


def _add_options(parser: argparse.ArgumentParser, table: Sequence[tuple[str, str, type, str]]) -> None:
    for flag, dest, _, help_text in table:
        parser.add_argument(flag, dest=dest, metavar="X", help=help_text)


def register(subparsers: argparse._SubParsersAction) -> None:
    db = subparsers.add_parser("db", help="database schema and the embedded PostgreSQL")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    db_sub.add_parser("upgrade", help="apply all migrations").set_defaults(func=_db_upgrade)
    down = db_sub.add_parser("downgrade", help="revert migrations (default: one revision)")
    down.add_argument("revision", nargs="?", default="-1", help="target revision, or 'base' (empty schema)")
    down.set_defaults(func=_db_downgrade)
    db_sub.add_parser("stop", help="stop the embedded PostgreSQL").set_defaults(func=_db_stop)
    url = db_sub.add_parser("url", help="print the database URL (starts the embedded server)")
    url.set_defaults(func=_db_url)

    tenant = subparsers.add_parser("tenant", help="manage tenants and their quotas")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", required=True, metavar="ACTION")
    create = tenant_sub.add_parser("create", help="create a tenant (limits: a number, or 'none' = unlimited)")
    create.add_argument("name")
    _add_options(create, _TENANT_OPTIONS + _QUOTA_OPTIONS)
    create.set_defaults(func=_tenant_create)
    tenant_sub.add_parser("list", help="list tenants").set_defaults(func=_tenant_list)
    show = tenant_sub.add_parser("show", help="a tenant, its quotas and keys")
    show.add_argument("name")
    show.set_defaults(func=_tenant_show)
    update = tenant_sub.add_parser("update", help="change weight, targets or limits ('none' = unlimited)")
    update.add_argument("name")
    _add_options(update, _TENANT_OPTIONS + _QUOTA_OPTIONS)
    update.set_defaults(func=_tenant_update)
    for action, status in (("suspend", "suspended"), ("resume", "active")):
        parser = tenant_sub.add_parser(action, help=f"{action} a tenant (its keys follow within seconds)")
        parser.add_argument("name")
        parser.set_defaults(func=_tenant_status(status))

    key = subparsers.add_parser("key", help="manage API keys")
    key_sub = key.add_subparsers(dest="key_command", required=True, metavar="ACTION")
    key_create = key_sub.add_parser("create", help="create a key (printed once)")
    key_create.add_argument("tenant")
    key_create.set_defaults(func=_key_create)
    key_list = key_sub.add_parser("list", help="a tenant's keys")
    key_list.add_argument("tenant")
    key_list.set_defaults(func=_key_list)
    revoke = key_sub.add_parser("revoke", help="revoke a tenant's key by id")
    revoke.add_argument("tenant", help="the key's tenant (name or id)")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=_key_revoke)

    usage = subparsers.add_parser("usage", help="usage, latency and shed requests")
    usage_sub = usage.add_subparsers(dest="usage_command", required=True, metavar="ACTION")
    usage_show = usage_sub.add_parser("show", help="usage per day and model, latency, shed counts")
    usage_show.add_argument("--tenant", help="only this tenant (name or id)")
    usage_show.add_argument("--since", help="UTC date or ISO time (default: 30 days ago)")
    usage_show.add_argument("--until", help="UTC date or ISO time (default: now)")
    usage_show.set_defaults(func=_usage_show)
    export = usage_sub.add_parser(
        "export", help="billing export (CSV, JSON Lines or FOCUS 1.2 CSV), streamed"
    )
    export.add_argument("--format", choices=("csv", "jsonl", "focus"), default="csv")
    export.add_argument("--since", required=True, help="UTC date or ISO time (inclusive)")
    export.add_argument("--until", required=True, help="UTC date or ISO time (exclusive)")
    export.add_argument("--tenant", help="only this tenant (name or id)")
    export.add_argument("--granularity", choices=("request", "hour", "day"), default="day")
    export.add_argument("--out", help="write to this file (default: standard output)")
    export.add_argument(
        "--price", help="FOCUS: price per cost unit (default: WEIR_PRICE_PER_COST_UNIT or 0.000002)"
    )
    export.set_defaults(func=_usage_export)
