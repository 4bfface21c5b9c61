"""Which backends ``weir serve`` sends its requests to, from ``--backend URL`` and ``--backends FILE``.

The TOML file:

    [pool]                        # optional; every key has a default
    initial_window = 2048         # cost units of outstanding work a backend is first given
    max_window = 65536            # the most a backend's window grows to
    probe_interval_s = 1.0        # how often a backend is checked (a failed one is probed back in)

    [[backends]]                  # a `weir engine`
    url = "http://10.0.0.5:9000"  # or "unix:/run/weir/engine.sock"

    [[backends]]                  # any OpenAI-compatible server (vLLM, SGLang, llama.cpp, TGI)
    kind = "openai"
    url = "http://gpu-1:8000/v1"  # its base URL, up to and including /v1
    model = "meta-llama/Llama-3.1-8B-Instruct"  # the name it serves (default: the first of its /models)
    max_model_len = 8192          # its context (default: the gateway's model's)

``--backend URL`` adds one backend: ``http://HOST:PORT`` or ``unix:PATH`` for a ``weir engine``,
``openai:BASE_URL[#MODEL]`` for an OpenAI-compatible server.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass

KINDS = ("weir", "openai")


class BackendConfigError(ValueError):
    """A backend list that cannot be used, with the reason."""


@dataclass(frozen=True)
class BackendSpec:
    """One backend: a ``weir engine`` or an OpenAI-compatible server."""

    url: str  # http(s)://... or unix:PATH (weir); the OpenAI base URL including /v1 (openai)
    kind: str = "weir"
    model: str | None = None  # openai: the model name it serves (None: ask its /models)
    max_model_len: int | None = None  # openai: its context (None: the gateway model's)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BackendConfigError(f"backend kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        schemes = ("http://", "https://") + (("unix:",) if self.kind == "weir" else ())
        if not self.url.startswith(schemes):
            raise BackendConfigError(f"backend URL must start with {' or '.join(schemes)}, got {self.url!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise BackendConfigError(f"max_model_len must be positive, got {self.max_model_len}")

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.url}" + (f"#{self.model}" if self.model else "")

    @classmethod
    def parse(cls, text: str) -> BackendSpec:
        """``http://HOST:PORT``, ``unix:PATH`` or ``openai:BASE_URL[#MODEL]``."""
        if text.startswith("openai:"):
            url, _, model = text.removeprefix("openai:").partition("#")
            return cls(url.rstrip("/"), "openai", model or None)
        return cls(text.rstrip("/"))


@dataclass(frozen=True)
class PoolConfig:
    """The backends and how the gateway's fair queue treats them (``api/pool.py``)."""

    backends: tuple[BackendSpec, ...]
    initial_window: float = 2048.0  # cost units of outstanding prefill + decode work
    max_window: float = 65536.0
    probe_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.backends:
            raise BackendConfigError("the backend list is empty")
        if not 0 < self.initial_window <= self.max_window:
            raise BackendConfigError("the pool needs 0 < initial_window <= max_window")
        if not self.probe_interval_s > 0:
            raise BackendConfigError("probe_interval_s must be positive")


_POOL_KEYS = {"initial_window", "max_window", "probe_interval_s"}
_BACKEND_KEYS = {"url", "kind", "model", "max_model_len"}


def load_pool_config(path: str | None, urls: list[str]) -> PoolConfig:
    """The backends of the file at ``path`` (if any) followed by ``urls``."""
    settings: dict = {}
    specs = []
    if path is not None:
        try:
            with open(path, "rb") as file:
                data = tomllib.load(file)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise BackendConfigError(f"--backends {path}: {exc}") from None
        settings = data.get("pool", {})
        entries = data.get("backends", [])
        unknown = set(settings) - _POOL_KEYS | set(data) - {"pool", "backends"}
        unknown |= {key for entry in entries for key in set(entry) - _BACKEND_KEYS}
        if unknown:
            raise BackendConfigError(f"--backends {path}: unknown keys: {', '.join(sorted(unknown))}")
        for entry in entries:
            if "url" not in entry:
                raise BackendConfigError(f"--backends {path}: every [[backends]] entry needs a url")
            specs.append(_checked(BackendSpec, entry))
    specs += [BackendSpec.parse(url) for url in urls]
    return _checked(PoolConfig, {"backends": tuple(specs), **settings})


def _checked(kind: type, values: dict):
    """``kind(**values)``, a value of the wrong type being a ``BackendConfigError``."""
    try:
        return kind(**values)
    except TypeError as exc:
        raise BackendConfigError(f"a value of the wrong type in the backend settings: {exc}") from None


@dataclass(frozen=True)
class PromptSource:
    """The prompt as the client sent it, for backends that take text: chat messages, or a completion's
    prompt (text or token ids)."""

    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
