"""Fused bf16 element-wise steps of a decoder layer (``csrc/layer_ops.cpp``): RMSNorm (alone or after the
residual add), RoPE with the paged-cache write, and the MLP's SiLU times up-projection, each one call
rounded as the torch ops it replaces (see the source's header).

Built and loaded by ``engine.models.extension`` the first time a bf16 model asks; where it cannot be built,
one warning is logged and the model keeps the torch ops (``engine.models.llama``'s reference path).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models.extension import extension_ready

SOURCE = Path(__file__).with_name("csrc") / "layer_ops.cpp"
NAME = "weir_layer_ops"


def fused_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the fused ops run a model of ``dtype`` on ``device`` (bf16 on a CPU, the extension built)."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    return extension_ready(NAME, SOURCE, "fused layer ops", "bf16 layers keep their torch ops")


def silu_mul_available() -> bool:
    """Whether ``silu_mul`` runs here (the built extension has it on a CPU with AVX-512)."""
    return bool(torch.ops.weir_layer.has_silu_mul())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of bf16 ``x`` [T, hidden] by ``weight``, rounded as Hugging Face's Llama rounds it."""
    return torch.ops.weir_layer.rms_norm(x, weight, eps)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Add ``delta`` into the residual stream ``hidden`` [T, hidden] in place; RMSNorm it by ``weight``."""
    return torch.ops.weir_layer.add_rms_norm(hidden, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused projection ``gate_up`` [T, 2 * I] (gate first), as [T, I]."""
    return torch.ops.weir_layer.silu_mul(gate_up)


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q [T, heads, D] and k [T, kv_heads, D] of the step's fused projection ``qkv``; the rotated
    k and the v are written to the caches at ``slots``."""
    return torch.ops.weir_layer.rope_and_cache(qkv, cos, sin, key_cache, value_cache, slots, heads, kv_heads)
