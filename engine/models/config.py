"""The model's shape and constants, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """What the paged Llama needs to know about a model."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_theta: float
    rope_type: str = "default"
    rope_params: dict[str, float] = field(default_factory=dict)  # scaling parameters of rope_type

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        """Read ``config.json`` in ``model_dir``; raise ValueError for what this engine cannot run."""
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ValueError(f"{model_dir} has no config.json") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``; raise ValueError for unsupported architectures or RoPE."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        rope_theta, rope_type, rope_params = _rope_settings(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_params=rope_params,
        )


def _rope_settings(raw: dict[str, Any]) -> tuple[float, str, dict[str, float]]:
    """(theta, type, scaling parameters) from either ``rope_parameters`` or the older ``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"RoPE scaling {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    return theta, rope_type, {k: float(v) for k, v in params.items() if isinstance(v, int | float)}
