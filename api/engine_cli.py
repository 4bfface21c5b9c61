"""``weir engine``: serve one engine to ``weir serve`` gateways over HTTP (a port or a unix socket)."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress

from api.drain import add_drain_option
from api.engine_options import add_engine_options, engine_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "engine",
        help="serve the engine alone, for `weir serve --backend`",
        description="Serve one engine (the model, its KV cache and scheduler) over Weir's engine protocol "
        "(docs/architecture.md, 'Backends'). No tenants or keys: bind it to a private address or a socket.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="with --port: the address to listen on")
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a --host that is not a loopback address (the engine checks no keys: whoever reaches "
        "the port gets unmetered inference as any tenant)",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int, help="listen on this TCP port")
    where.add_argument("--socket", metavar="PATH", help="listen on this unix socket")
    add_engine_options(parser)
    add_drain_option(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(func=_engine)


def _engine(args: argparse.Namespace) -> int:
    if args.port is not None:
        if not 0 < args.port < 65536:
            raise SystemExit(f"weir engine: error: --port must be in 1..65535, got {args.port}")
        if not (args.allow_remote or _is_loopback(args.host)):
            raise SystemExit(
                f"weir engine: error: --host {args.host} is not a loopback address: the engine checks no "
                "keys, so anyone who reaches it gets unmetered inference as any tenant; listen on 127.0.0.1 "
                "or a --socket, or pass --allow-remote on a private network"
            )
    config = engine_config(args, "engine")
    import logging

    from api.engine_server import run_engine_server
    from engine.client import AsyncEngine
    from engine.weights import resolve_model_dir

    try:
        model_dir = resolve_model_dir(args.model, config.resolved_state_dir())
    except ValueError as exc:
        raise SystemExit(f"weir engine: error: {exc}") from None
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine = AsyncEngine(dataclasses.replace(config, model=str(model_dir)))
    run_engine_server(engine, args.host, args.port, args.socket, args.log_level, args.drain_timeout)
    return 0


def _is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address (a hostname or ``0.0.0.0`` is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
