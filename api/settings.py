"""What ``weir serve`` is configured with (command-line flags and environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from api.backends import PoolConfig
from engine.config import EngineConfig
from engine.cost import DEFAULT_WEIGHTS, CostWeights


@dataclass(frozen=True)
class Settings:
    """Everything ``create_app`` needs; defaults are what ``weir serve`` uses with no flags (its flags take
    their defaults from here and from ``EngineConfig``)."""

    engine: EngineConfig = field(default_factory=EngineConfig)  # model, state directory, engine limits
    model_name: str | None = None  # the name clients send as "model"; default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    database_url: str | None = field(default_factory=lambda: os.environ.get("DATABASE_URL") or None)
    admin_token: str | None = field(default_factory=lambda: os.environ.get("WEIR_ADMIN_TOKEN") or None)
    client_timeout_s: float = 30.0  # drop a connection whose client has not read for this long
    send_buffer_bytes: int = 16384  # unsent bytes held per connection before a slow reader blocks its stream
    max_body_bytes: int = 1_000_000
    max_waiting: int = 256  # shed (queue) when this many requests already wait in the engine
    # refuse a queued request not started by its tenant's TTFT target plus this (never serve it late)
    deadline_grace_s: float = 1.0
    weights: CostWeights = DEFAULT_WEIGHTS  # what reservations and the ledger count in
    log_format: str = "text"  # text, or json: one object a line with trace ids, and a line per request
    metrics_public: bool = False  # serve GET /metrics without the admin token
    metrics_max_tenants: int = 100  # tenants with a metric label of their own; later ones count as "other"
    backends: PoolConfig | None = (
        None  # remote backends behind the gateway's fair queue; None: the engine here
    )

    @property
    def state_dir(self) -> Path:
        """The state directory (the engine's: ``$WEIR_STATE_DIR``, else ``./.weir``)."""
        return self.engine.resolved_state_dir()
