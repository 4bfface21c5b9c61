"""Rotary position embeddings: cos and sin of the step's positions, computed once per step."""

from __future__ import annotations

import math

import torch

from engine.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2], with the config's scaling (default, linear, llama3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    params = config.rope_params
    if config.rope_type == "linear":
        return inv_freq / params["factor"]
    if config.rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class Rotary:
    """cos and signed sin of each step's positions, computed as Hugging Face does (fp32 angles)."""

    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        self.inv_freq = inverse_frequencies(config).to(device)
        self.max_positions = config.max_position_embeddings
        self.dtype = dtype

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[-sin, sin]``, each [T, 1, head_dim], ready to broadcast over heads."""
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(positions.max())} is beyond the model's context ({self.max_positions})"
            )
        freqs = torch.outer(positions.float(), self.inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1).to(self.dtype).unsqueeze(1)
        sin = torch.cat((-sin, sin), dim=-1).to(self.dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] (the rotate-half layout of Hugging Face Llama); ``sin`` is signed."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    if x.dtype == torch.float32:
        return torch.addcmul(x * cos, swapped, sin)
    return x * cos + swapped * sin  # rounded after each product, as Hugging Face's Llama does
