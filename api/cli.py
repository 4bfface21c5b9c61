"""The ``weir`` command line: one entry point, subcommands registered by each package.

Each registering module keeps its imports light (torch, SQLAlchemy and Litestar are imported inside the
command functions), so ``weir --help`` is instant. A user-facing failure is
``raise SystemExit("weir X: error: ...")``: one line on stderr, exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules exposing ``register(subparsers)``; each added parser sets ``func(args) -> int``.
COMMAND_MODULES = (
    "engine.cli",  # generate, model import
    "tenants.cli",  # db, tenant, key, usage
    "api.serve_cli",  # serve, demo
    "api.engine_cli",  # engine
    "bench.cli",  # bench engine, bench serve
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weir", description="Weir: multi-tenant LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
