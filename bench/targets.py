"""The servers a benchmark compares: ``--base-url`` and each ``--peer NAME=URL[@MODEL]``, with their keys.

A peer needs no API key: it is sent a dummy bearer (``EMPTY``) unless ``--peer-keys NAME=FILE`` gives it
keys (another Weir standing in as a peer needs real ones). Its model id is the one after ``@``, else the
first that its ``GET /models`` lists.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import httpx

from bench.http_load import ChatSession, LoadRequest, run_load, served_model

DUMMY_KEY = "EMPTY"
WARM_UP_PROMPT = "Hello."  # shorter than a KV block, so it leaves nothing in a prefix cache
Item = TypeVar("Item", LoadRequest, ChatSession)


@dataclass(frozen=True)
class Target:
    """One server of a comparison: its label, OpenAI base URL, keys (dealt round-robin) and model id
    (None: ask the server)."""

    name: str
    base_url: str
    keys: tuple[str | None, ...] = (DUMMY_KEY,)
    model: str | None = None

    def deal(self, load: Sequence[Item]) -> list[Item]:
        """The load with this server's keys dealt round-robin over its items."""
        return [replace(item, api_key=self.keys[i % len(self.keys)]) for i, item in enumerate(load)]

    async def ready_model(self, command: str) -> str:
        """The model id to request, once one short warm-up request has been answered."""
        where = f"weir bench {command}: error: {self.name} at {self.base_url}"
        try:
            model = self.model or await served_model(self.base_url, self.keys[0])
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise SystemExit(f"{where}: cannot list models ({exc})") from None
        [warm] = await run_load(self.base_url, model, [LoadRequest(0.0, WARM_UP_PROMPT, 4, self.keys[0])])
        if not warm.ok:
            raise SystemExit(f"{where}: the warm-up request failed ({warm.error or f'HTTP {warm.status}'})")
        return model


def read_keys(path: str | None, tenants: int | None, command: str = "serve") -> list[str | None]:
    """The first ``tenants`` keys of the file (all when None; one per line, ``#`` comments), or no key."""
    if path is None:
        if tenants is not None and tenants > 1:
            raise SystemExit(
                f"weir bench {command}: error: --tenants above 1 needs --keys FILE (one key per tenant)"
            )
        return [None]
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise SystemExit(f"weir bench {command}: error: cannot read {path}: {exc.strerror}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise SystemExit(f"weir bench {command}: error: {path} holds no key")
    if tenants is not None and len(keys) < tenants:
        raise SystemExit(
            f"weir bench {command}: error: --tenants {tenants} but {path} holds {len(keys)} key(s)"
        )
    return keys[:tenants]


def parse_peer(text: str) -> tuple[str, str, str | None]:
    """``NAME=URL[@MODEL]`` as (name, base URL, model id or None); the model is what follows the first
    ``@`` in the URL's path, so a URL of the form ``http://user@host/v1`` keeps its user."""
    name, sep, rest = text.partition("=")
    scheme, slashes, after = rest.partition("://")
    if not (sep and name and slashes and scheme in ("http", "https")):
        raise ValueError(f"--peer takes NAME=http(s)://HOST:PORT/PATH[@MODEL], got {text!r}")
    host, slash, path = after.partition("/")
    path, at, model = path.partition("@")
    if at and not model:
        raise ValueError(f"--peer {text!r} names no model after '@'")
    return name, f"{scheme}://{host}{slash}{path}", model or None


def comparison_targets(args: argparse.Namespace, command: str, tenants: int | None) -> list[Target]:
    """``--base-url`` (named ``--name``, with ``--keys`` and ``--model-name``), then each ``--peer``."""
    if not args.base_url.startswith(("http://", "https://")):
        raise SystemExit(
            f"weir bench {command}: error: --base-url must start with http:// or https://, "
            f"got {args.base_url!r}"
        )
    targets = [
        Target(args.name, args.base_url, tuple(read_keys(args.keys, tenants, command)), args.model_name)
    ]
    peer_keys = dict(_pair(text, "--peer-keys", command) for text in args.peer_keys)
    for text in args.peer:
        try:
            name, url, model = parse_peer(text)
        except ValueError as exc:
            raise SystemExit(f"weir bench {command}: error: {exc}") from None
        keys = read_keys(peer_keys.pop(name), tenants, command) if name in peer_keys else [DUMMY_KEY]
        targets.append(Target(name, url, tuple(keys), model))
    names = [t.name for t in targets]
    if len(set(names)) < len(names):
        raise SystemExit(f"weir bench {command}: error: two servers are named alike: {', '.join(names)}")
    if peer_keys:
        raise SystemExit(f"weir bench {command}: error: --peer-keys names no --peer: {', '.join(peer_keys)}")
    return targets


def _pair(text: str, option: str, command: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not (sep and name and value):
        raise SystemExit(f"weir bench {command}: error: {option} takes NAME=VALUE, got {text!r}")
    return name, value
