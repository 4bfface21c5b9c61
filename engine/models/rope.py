"""Rotary position embeddings: a cos/sin table over all positions, looked up once per step."""

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


class RotaryTable:
    """cos and signed sin for every position up to the model's maximum, each [max_positions, head_dim]."""

    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inverse_frequencies(config))
        self.cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1).to(device=device, dtype=dtype)
        # sin with the rotate-half sign folded in: [-sin, sin]
        self.sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)
        self.max_positions = config.max_position_embeddings

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, head_dim] for the step's positions, ready to broadcast over heads."""
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(positions.max())} is beyond the model's context ({self.max_positions})"
            )
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] (the rotate-half layout of Hugging Face Llama); ``sin`` is signed."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)
