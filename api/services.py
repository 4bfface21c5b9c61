"""The parts one API process runs, built once by ``create_app`` and started in its lifespan.

``Services`` wires the engine, the tenant store, admission and settlement together and owns their order:
the engine and the store start before the process is ready; on a stop signal the drain (``api/drain.py``)
lets admitted requests end first; on shutdown every settlement in flight ends before the store closes, and
the engine stops last.
"""

from __future__ import annotations

import logging

from api.admission import Admission
from api.drain import Drain
from api.heap import freeze_startup_heap
from api.pool import BackendPool
from api.refusals import draining, model_not_found, not_ready
from api.settings import Settings
from api.settlement import Settlement
from api.tenant_store import TenantStore
from engine.client import AsyncEngine

log = logging.getLogger("weir.api")


class ServedModel:
    """The model this process serves, under the name clients send."""

    def __init__(self, engine: AsyncEngine | BackendPool, name: str | None) -> None:
        self._engine = engine
        self._name = name

    @property
    def name(self) -> str:
        """``--model-name``, else the model directory's name (known once the engine started)."""
        return self._name or self._engine.model_name

    def check(self, model: str) -> None:
        """404 unless ``model`` is the name this server serves."""
        if model != self.name:
            raise model_not_found(model, self.name)

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "weir"}


class Services:
    """Engine, tenant store, admission and settlement of one API process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine: AsyncEngine | BackendPool = (
            AsyncEngine(settings.engine)
            if settings.backends is None
            else BackendPool(settings.backends, settings.engine, settings.weights, settings.deadline_grace_s)
        )
        self.model = ServedModel(self.engine, settings.model_name)
        self.store = TenantStore(settings.database_url, settings.state_dir / "spill")
        self.admission = Admission(self.engine, self.model, self.store, settings)
        self.settlement = Settlement(self.store, self.engine, settings.weights)
        self.drain = Drain()
        self.ready = False

    async def start(self) -> None:
        await self.engine.start()
        await self.store.open()
        freeze_startup_heap()
        self.ready = True
        log.info("serving model %s", self.model.name)

    async def stop(self) -> None:
        self.ready = False
        await self.settlement.drain()
        await self.store.close()
        await self.engine.stop()

    def check_ready(self) -> None:
        """503 until the model is loaded and the tenant store open."""
        if not self.ready:
            raise not_ready()

    def check_accepting(self) -> None:
        """503 until ready, and while the process drains before it stops (new requests go elsewhere)."""
        self.check_ready()
        if self.drain.draining:
            raise draining()
