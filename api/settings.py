"""What ``weir serve`` is configured with (command-line flags and environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    """Everything ``create_app`` needs; defaults are what ``weir serve`` uses with no flags."""

    model: str | None = None  # a Hugging Face Llama-family directory; None: the default SmolLM2
    model_name: str | None = None  # the name clients send as "model"; default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    state_dir: Path = field(default_factory=lambda: Path(os.environ.get("WEIR_STATE_DIR", ".weir")))
    database_url: str | None = field(default_factory=lambda: os.environ.get("DATABASE_URL") or None)
    admin_token: str | None = field(default_factory=lambda: os.environ.get("WEIR_ADMIN_TOKEN") or None)
    client_timeout_s: float = 30.0  # drop a connection whose client has not read for this long
    send_buffer_bytes: int = 16384  # unsent bytes held per connection before a slow reader blocks its stream
    max_body_bytes: int = 1_000_000
    max_waiting: int = 256  # shed (queue) when this many requests already wait in the engine
    engine_options: dict = field(
        default_factory=dict
    )  # extra EngineConfig fields (kv memory, batch tokens, ...)
    log_format: str = "text"  # text, or json: one object a line with trace ids, and a line per request
    metrics_public: bool = False  # serve GET /metrics without the admin token
    metrics_max_tenants: int = 100  # tenants with a metric label of their own; later ones count as "other"
