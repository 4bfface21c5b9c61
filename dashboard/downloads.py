"""The exports page and the billing downloads (CSV, JSONL, FOCUS 1.2 CSV), streamed row by row."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

from litestar import Request, get
from litestar.response import Stream, Template

from dashboard.access import PREFIX, Dashboard, Refused
from dashboard.ranges import iso_text, parse_moment
from tenants.admin import get_tenant, list_tenants
from tenants.exports import (
    GRANULARITIES,
    FocusSettings,
    check_range,
    csv_chunks,
    export_rows,
    focus_chunks,
    jsonl_chunks,
)

FORMATS = {"usage.csv": "CSV", "usage.jsonl": "JSON Lines", "usage.focus.csv": "FOCUS 1.2 CSV"}


@get(f"{PREFIX}/exports")
async def exports_page(request: Request, dash: Dashboard) -> Template:
    session = dash.admin(request)
    today = datetime.now(UTC).date()
    return dash.page(
        request,
        session,
        "exports.html",
        formats=FORMATS,
        granularities=GRANULARITIES,
        tenants=await list_tenants(dash.sources.db()),
        default_since=today.replace(day=1).isoformat(),
        default_until=(today + timedelta(days=1)).isoformat(),
    )


@get(f"{PREFIX}/exports/{{file:str}}")
async def download(
    request: Request,
    dash: Dashboard,
    file: str,
    since: str | None = None,
    until: str | None = None,
    granularity: str = "day",
    tenant: str | None = None,
) -> Stream:
    """One export, streamed as it is read: ``since`` and ``until`` (UTC ISO dates or times, ``until``
    not included) are required; ``tenant`` (a name) narrows it to one tenant."""
    dash.admin(request)
    if file not in FORMATS:
        raise Refused(404, f"No export {file!r}: the downloads are {', '.join(FORMATS)}.")
    if not since or not until:
        raise Refused(400, "An export needs since and until (UTC ISO dates, until not included).")
    start, end = parse_moment("since", since), parse_moment("until", until)
    check_range(start, end, granularity)
    db = dash.sources.db()
    tenant_id = (await get_tenant(db, tenant)).id if tenant else None
    rows = export_rows(db, start, end, granularity, tenant_id)  # type: ignore[arg-type]  # checked above
    chunks: AsyncIterator[str]
    if file == "usage.jsonl":
        chunks, media_type = jsonl_chunks(rows), "application/jsonl; charset=utf-8"
    elif file == "usage.focus.csv":
        chunks, media_type = focus_chunks(rows, FocusSettings.from_env()), "text/csv; charset=utf-8"
    else:
        chunks, media_type = csv_chunks(rows), "text/csv; charset=utf-8"
    period = f"{iso_text(start)}-{iso_text(end)}".replace(":", "")  # the parsed moments, never the raw text
    name = f"weir-{file.replace('usage', f'usage-{granularity}-{period}')}"
    return Stream(
        chunks,
        media_type=media_type,
        headers={"content-disposition": f'attachment; filename="{name}"', "cache-control": "no-store"},
    )


ROUTES = [exports_page, download]
