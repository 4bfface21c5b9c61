"""What the dashboard reads, handed in by the application: the database, the engine's stats, the token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from engine.types import EngineStats


class Unavailable(Exception):
    """The server is still starting (no database or engine yet)."""


@dataclass(frozen=True)
class DashboardSources:
    """Callables, because the database and the engine start after the routes are built.

    ``database`` and ``engine_stats`` return ``None`` until the server is ready."""

    database: Callable[[], AsyncEngine | None]
    engine_stats: Callable[[], EngineStats | None]
    model_name: Callable[[], str]
    admin_token: str | None

    def db(self) -> AsyncEngine:
        """The database, or :class:`Unavailable` while the server starts."""
        db = self.database()
        if db is None:
            raise Unavailable("The server is starting; reload the page in a moment.")
        return db
