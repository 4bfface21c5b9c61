"""Background tasks that belong to no request.

A task copies the context it is created in. The store's background work (the quota sync, the ledger
writer, the keys' last-use flush, slice top-ups) is started lazily, from inside whichever request first
needs it; with a copied context its work would run as part of that request (a request's trace, for one,
would collect every later sync's spans). ``detached`` starts such work in an empty context instead.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def detached(coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
    """Run ``coro`` as a task on the running loop in a fresh, empty context."""
    return asyncio.get_running_loop().create_task(coro, name=name, context=contextvars.Context())
