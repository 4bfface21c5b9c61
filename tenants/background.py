"""Background tasks that belong to no request.

A task copies the context it is created in. The store's background work (the quota sync, the ledger
writer, the keys' last-use flush, slice top-ups) is started lazily, from inside whichever request first
needs it; with a copied context its work would run as part of that request (a request's trace, for one,
would collect every later sync's spans). ``detached`` starts such work in a context of its own instead:
an empty one, or a copy of the one the embedding service hands ``run_background_in`` (the API's tells its
SQL tracing to stay out of the store's housekeeping).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_background = contextvars.Context()


def run_background_in(context: contextvars.Context) -> None:
    """Start every later background task in a copy of ``context`` (a context no request runs in)."""
    global _background  # noqa: PLW0603 - one setting for the process, made at start-up
    _background = context


def detached(coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
    """Run ``coro`` as a task on the running loop in a copy of the background context."""
    return asyncio.get_running_loop().create_task(coro, name=name, context=_background.copy())
