"""``weir serve`` (the API) and ``weir demo`` (a first tenant and its key, or a week of synthetic usage)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets

from api.drain import DRAIN_TIMEOUT_S, add_drain_option
from api.engine_options import add_engine_options, engine_config
from api.request_log import LOG_FORMATS, configure_logging
from api.settings import Settings
from api.transport_limits import MAX_HEADER_BYTES, TransportLimits


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible API",
        description="Serve the OpenAI-compatible API. Migrates the database first (embedded PostgreSQL "
        "when DATABASE_URL is unset). Prints an admin token when WEIR_ADMIN_TOKEN is unset.",
    )
    serve.add_argument("--host", default=Settings.host)
    serve.add_argument("--port", type=int, default=Settings.port)
    serve.add_argument("--model-name", help="the model name clients send (default: the directory's name)")
    serve.add_argument(
        "--client-timeout",
        type=float,
        default=Settings.client_timeout_s,
        metavar="SECONDS",
        help="drop a connection whose client has not read for this long "
        f"(default {Settings.client_timeout_s:g})",
    )
    add_engine_options(serve)
    serve.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="serve through this backend instead of an engine of its own (repeatable): a `weir engine` "
        "(http://HOST:PORT or unix:PATH) or an OpenAI-compatible server (openai:BASE_URL[#MODEL]); "
        "--model still names the tokenizer and chat template",
    )
    serve.add_argument(
        "--backends", metavar="FILE", help="a TOML file listing the backends and the pool's settings"
    )
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=Settings.max_waiting,
        help=f"shed new requests when this many wait in the engine (default {Settings.max_waiting})",
    )
    serve.add_argument(
        "--deadline-grace",
        type=float,
        default=Settings.deadline_grace_s,
        metavar="S",
        help="refuse (503) a queued request not started within its tenant's TTFT target plus this many "
        f"seconds, before any byte of its answer (default {Settings.deadline_grace_s})",
    )
    serve.add_argument(
        "--max-body-bytes", type=int, default=Settings.max_body_bytes, help="largest request body accepted"
    )
    add_drain_option(serve)
    _add_transport_options(serve)
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    _add_telemetry_options(serve)
    serve.set_defaults(func=_serve)

    demo = subparsers.add_parser(
        "demo", help="create a demo tenant and API key if no tenant exists (prints the key once)"
    )
    demo.add_argument(
        "--traffic",
        action="store_true",
        help="instead, fill the database with a week of synthetic usage and refusals for a few tenants",
    )
    demo.add_argument("--days", type=int, default=7, help="with --traffic: days of usage (default 7)")
    demo.add_argument(
        "--requests", type=int, default=50_000, help="with --traffic: requests in all (default 50,000)"
    )
    demo.set_defaults(func=_demo)


def _add_transport_options(serve: argparse.ArgumentParser) -> None:
    """Connection cap and read deadlines (see ``api/http_protocol.py``)."""
    limits = TransportLimits()
    options = {
        "--max-connections": (
            limits.max_connections,
            "serve at most N connections at once; a request on one more gets a 503",
        ),
        "--max-connections-per-address": (
            limits.max_connections_per_address,
            "serve at most N connections at once from one client address (behind a proxy: all of them)",
        ),
        "--header-timeout": (
            limits.header_timeout_s,
            "close a connection whose request headers are not complete this long after it opened or the "
            "request began",
        ),
        "--body-timeout": (
            limits.body_timeout_s,
            "answer 408 and close when a request body is not complete this long after its headers",
        ),
        "--keep-alive-timeout": (
            limits.keep_alive_timeout_s,
            "close a connection idle this long between requests",
        ),
    }
    for flag, (default, text) in options.items():
        metavar = "N" if isinstance(default, int) else "SECONDS"
        serve.add_argument(
            flag, type=type(default), default=default, metavar=metavar, help=f"{text} (default {default:g})"
        )


def _add_telemetry_options(serve: argparse.ArgumentParser) -> None:
    """Log format and /metrics access (traces and metrics export: the OTEL_* variables, docs/telemetry.md)."""
    serve.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="json: one JSON object a line with the request's trace id, and one line per finished "
        "request (default text)",
    )
    serve.add_argument(
        "--metrics-public", action="store_true", help="serve GET /metrics without the admin token"
    )
    serve.add_argument(
        "--metrics-max-tenants",
        type=int,
        default=Settings.metrics_max_tenants,
        metavar="N",
        help="tenants with a metric label of their own; later ones are counted as 'other' "
        f"(default {Settings.metrics_max_tenants})",
    )


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise SystemExit(f"weir serve: error: --{name} must be positive, got {value}")


def _serve(args: argparse.Namespace) -> int:
    for name in (
        "client_timeout",
        "max_waiting",
        "max_body_bytes",
        "max_connections",
        "max_connections_per_address",
        "header_timeout",
        "body_timeout",
        "keep_alive_timeout",
        "metrics_max_tenants",
    ):
        _positive(name.replace("_", "-"), getattr(args, name))
    if not args.deadline_grace >= 0:
        raise SystemExit(
            f"weir serve: error: --deadline-grace must be non-negative, got {args.deadline_grace}"
        )
    from api.telemetry import check_environment

    try:
        check_environment(os.environ)
    except ValueError as exc:
        raise SystemExit(f"weir serve: error: {exc}") from None
    from engine.weights import resolve_model_dir

    engine = engine_config(args, "serve")
    backends = _backends(args)
    if not 0 < args.port < 65536:
        raise SystemExit(f"weir serve: error: --port must be in 1..65535, got {args.port}")

    from tenants.db import DatabaseError, database_url, upgrade_to_head

    try:
        model_dir = resolve_model_dir(args.model, engine.resolved_state_dir())
    except ValueError as exc:
        raise SystemExit(f"weir serve: error: {exc}") from None
    from sqlalchemy.exc import SQLAlchemyError

    try:
        url = database_url()
        upgrade_to_head(url)
    except (DatabaseError, SQLAlchemyError, OSError) as exc:
        raise SystemExit(f"weir serve: error: database: {exc}") from None

    admin_token = os.environ.get("WEIR_ADMIN_TOKEN")
    if not admin_token:
        admin_token = secrets.token_urlsafe(24)
        print(f"Admin token (set WEIR_ADMIN_TOKEN to choose your own): {admin_token}", flush=True)

    settings = Settings(
        engine=dataclasses.replace(engine, model=str(model_dir)),
        model_name=args.model_name,
        host=args.host,
        port=args.port,
        database_url=url,
        admin_token=admin_token,
        client_timeout_s=args.client_timeout,
        max_body_bytes=args.max_body_bytes,
        max_waiting=args.max_waiting,
        deadline_grace_s=args.deadline_grace,
        log_format=args.log_format,
        metrics_public=args.metrics_public,
        metrics_max_tenants=args.metrics_max_tenants,
        backends=backends,
    )
    limits = TransportLimits(
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
    )
    run_server(settings, limits, args.log_level, args.drain_timeout)
    return 0


def _backends(args: argparse.Namespace):  # -> api.backends.PoolConfig | None
    """The pool from ``--backends FILE`` and ``--backend URL`` (None: the in-process engine)."""
    from api.backends import BackendConfigError, load_pool_config

    if args.backends is None and not args.backend:
        return None
    try:
        return load_pool_config(args.backends, args.backend)
    except BackendConfigError as exc:
        raise SystemExit(f"weir serve: error: {exc}") from None


class _DroppedClientFilter(logging.Filter):
    """Hide uvicorn's error for a response left incomplete on purpose: a stalled client that was dropped
    (logged by the API itself with the request and tenant)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing response."


def run_server(
    settings: Settings,
    limits: TransportLimits,
    log_level: str = "info",
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
) -> None:
    """Serve ``create_app(settings)`` with uvicorn, within ``limits``, until a stop signal and the drain
    that follows it (``api/drain.py``)."""
    import uvicorn

    from api.app import create_app
    from api.draining_server import DrainingServer
    from api.http_protocol import limited_protocol

    configure_logging(settings.log_format, log_level)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=limited_protocol(limits, settings.send_buffer_bytes),
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]  # a float works
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        lifespan="on",
        log_level=log_level,
        # X-Forwarded-For/-Proto only from the proxies FORWARDED_ALLOW_IPS names (uvicorn trusts loopback)
        proxy_headers="FORWARDED_ALLOW_IPS" in os.environ,
        **({"log_config": None} if settings.log_format == "json" else {}),  # uvicorn's lines in JSON too
    )
    logging.getLogger("uvicorn.error").addFilter(_DroppedClientFilter())  # after uvicorn's logging setup
    server = DrainingServer(config, app.state.services.drain, drain_timeout_s)
    server.run()
    if not server.started:
        raise SystemExit("weir serve: error: the server did not start (see the log above)")


def _demo(args: argparse.Namespace) -> int:
    import asyncio

    from api.demo import ensure_demo_tenant, seed_traffic

    if args.traffic:
        return asyncio.run(seed_traffic(args.days, args.requests))
    return asyncio.run(ensure_demo_tenant())
