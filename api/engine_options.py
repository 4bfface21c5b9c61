"""The engine's command-line flags, shared by ``weir serve`` (its in-process engine) and ``weir engine``."""

from __future__ import annotations

import argparse

from engine.config import DTYPES, EngineConfig


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Model, dtype, KV memory and scheduling limits (flags not given keep ``EngineConfig``'s defaults)."""
    parser.add_argument(
        "--model", help="a Hugging Face Llama-family directory (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--kv-cache-memory", type=int, metavar="MIB", help="KV cache size in MiB")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=EngineConfig.dtype,
        help=f"compute dtype (default {EngineConfig.dtype}: the fastest, measured)",
    )
    parser.add_argument("--max-batched-tokens", type=int, help="tokens per engine step")
    parser.add_argument("--max-num-seqs", type=int, help="running sequences at most")
    parser.add_argument(
        "--policy", help="scheduling policy: fair (weighted fair share by cost, the default) or fcfs"
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt in full (default: share full blocks of a tenant's repeated prefixes)",
    )


def engine_config(args: argparse.Namespace, command: str) -> EngineConfig:
    """The engine's flags as its config; a bad value exits with ``weir COMMAND: error: ...``."""
    from engine.policies import POLICIES

    for name in ("kv_cache_memory", "max_batched_tokens", "max_num_seqs"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise SystemExit(
                f"weir {command}: error: --{name.replace('_', '-')} must be positive, got {value}"
            )
    if args.policy is not None and args.policy not in POLICIES:
        raise SystemExit(f"weir {command}: error: --policy must be one of {', '.join(sorted(POLICIES))}")
    options = {"dtype": args.dtype, "prefix_caching": args.prefix_caching}
    if args.kv_cache_memory is not None:
        options["kv_cache_memory"] = args.kv_cache_memory << 20
    for name in ("max_batched_tokens", "max_num_seqs", "policy"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    try:
        return EngineConfig(**options)
    except ValueError as exc:
        raise SystemExit(f"weir {command}: error: {exc}") from None
