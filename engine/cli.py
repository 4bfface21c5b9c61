"""``weir generate`` (stream one chat answer to the terminal) and ``weir model import``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.config import DEVICES, DTYPES, EngineConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser("generate", help="stream the answer to a prompt (chat template applied)")
    gen.add_argument("prompt", help="the user message")
    gen.add_argument("--model", default=None, help="Hugging Face Llama-family directory (default: SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (default 0: off)")
    gen.add_argument("--seed", type=int, default=None, help="same seed, same answer (when sampling)")
    gen.add_argument("--device", default=EngineConfig.device, choices=DEVICES)
    gen.add_argument(
        "--dtype",
        default=EngineConfig.dtype,
        choices=DTYPES,
        help=f"compute dtype (default {EngineConfig.dtype}: measured)",
    )
    gen.set_defaults(func=generate_command)

    model = subparsers.add_parser("model", help="manage model weights")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    imp = model_sub.add_parser("import", help="import the default SmolLM2 from its GGUF into the local cache")
    imp.add_argument("--force", action="store_true", help="re-import even if the cache exists")
    imp.set_defaults(func=import_command)


def generate_command(args: argparse.Namespace) -> int:
    from engine.core import EngineCore
    from engine.types import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        config = EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype, kv_cache_memory=256 << 20
        )
        core = EngineCore.from_config(config, progress=sys.stderr.isatty())
    except ValueError as exc:
        raise SystemExit(f"weir generate: error: {exc}") from None
    prompt = core.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    if len(prompt) >= core.max_model_len:
        raise SystemExit(f"weir generate: error: the prompt has {len(prompt)} tokens: too many")
    core.add_request("cli", prompt, params)
    while core.has_unfinished():
        for out in core.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.error:
                raise SystemExit(f"weir generate: error: {out.error}")
    sys.stdout.write("\n")
    return 0


def import_command(args: argparse.Namespace) -> int:
    import shutil

    from engine.weights import default_model_dir, import_default_model, state_dir_from_env

    state_dir = state_dir_from_env()
    if args.force and default_model_dir(state_dir).exists():
        shutil.rmtree(default_model_dir(state_dir))
    try:
        path = import_default_model(Path(state_dir), progress=True)
    except ValueError as exc:
        raise SystemExit(f"weir model import: error: {exc}") from None
    print(path)
    return 0
