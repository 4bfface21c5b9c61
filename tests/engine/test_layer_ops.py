"""The fused bf16 layer ops give the bits of the torch ops they replace (the reference path)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.models import layer_ops
from engine.models.config import ModelConfig
from engine.models.llama import rms_norm
from engine.models.rope import Rotary, apply_rotary


def test_the_ops_build_here_for_bf16_only() -> None:
    assert layer_ops.fused_available(torch.bfloat16, torch.device("cpu"))
    assert not layer_ops.fused_available(torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("tokens", [1, 3, 300])
@pytest.mark.parametrize("width", [576, 100])  # 100: six vectors of 16 values and a tail of 4
def test_rms_norm_rounds_as_the_torch_ops(tokens: int, width: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, width, generator=generator) * 4).bfloat16()
    weight = torch.randn(width, generator=generator).bfloat16()
    assert torch.equal(layer_ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("tokens", [1, 3, 300])
def test_add_rms_norm_adds_in_place_as_torch_then_normalizes_as_rms_norm(tokens: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    hidden = (torch.randn(tokens, 576, generator=generator) * 4).bfloat16()
    delta = (torch.randn(tokens, 576, generator=generator) * 4).bfloat16()
    weight = torch.randn(576, generator=generator).bfloat16()
    expected_stream = hidden.clone().add_(delta)
    stream = hidden.clone()
    normed = layer_ops.add_rms_norm(stream, delta, weight, 1e-5)
    assert torch.equal(stream, expected_stream)
    assert torch.equal(normed, layer_ops.rms_norm(expected_stream, weight, 1e-5))


def test_silu_mul_rounds_as_the_torch_ops_for_every_bf16_gate() -> None:
    """Every one of the 65536 bf16 values as a gate (NaNs, infinities and subnormals among them), each
    times a random up value: the bits of torch's ``silu`` then ``mul``."""
    if not layer_ops.silu_mul_available():
        pytest.skip("silu_mul needs AVX-512; the model keeps torch's silu and mul here")
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.randn(every.numel(), generator=torch.Generator().manual_seed(0)).bfloat16()
    gate_up = torch.cat([every.view(-1, 2048), up.view(-1, 2048)], dim=1)
    gate, up_half = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate.clone()).mul_(up_half)
    got = layer_ops.silu_mul(gate_up)
    both_nan = torch.isnan(got.float()) & torch.isnan(expected.float())
    assert bool(((got.view(torch.int16) == expected.view(torch.int16)) | both_nan).all())


@pytest.mark.parametrize("tokens", [1, 5, 300])
@pytest.mark.parametrize(
    "shape", [None, (9, 3, 64)], ids=["tiny", "smollm2"]
)  # (heads, KV heads, head size); head size 16 takes the scalar rotation, 64 vectors of 16 values (AVX-512)
def test_rope_and_cache_rotates_and_writes_as_the_torch_ops(
    tiny_model_dir: Path, tokens: int, shape: tuple[int, int, int] | None
) -> None:
    generator = torch.Generator().manual_seed(tokens)
    config = ModelConfig.from_dir(tiny_model_dir)
    if shape is not None:
        config = dataclasses.replace(config, num_heads=shape[0], num_kv_heads=shape[1], head_dim=shape[2])
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=generator).bfloat16()
    positions = torch.randint(0, config.max_position_embeddings, (tokens,), generator=generator)
    cos, sin = Rotary(config, "cpu", torch.bfloat16).lookup(positions)
    keys = torch.zeros(tokens + 20, kv_heads, head_dim, dtype=torch.bfloat16)
    values = torch.zeros_like(keys)
    slots = torch.randperm(tokens + 20, generator=generator)[:tokens]

    q, k = layer_ops.rope_and_cache(qkv, cos, sin, keys, values, slots, heads, kv_heads)

    rotated = apply_rotary(qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim), cos, sin)
    assert torch.equal(q, rotated[:, :heads]) and torch.equal(k, rotated[:, heads:])
    assert torch.equal(keys[slots], k)
    assert torch.equal(
        values[slots], qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    )
    untouched = torch.ones(tokens + 20, dtype=torch.bool)
    untouched[slots] = False
    assert not keys[untouched].any() and not values[untouched].any()


def test_rope_and_cache_refuses_a_slot_outside_the_cache(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_model_dir)
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    cos, sin = Rotary(config, "cpu", torch.bfloat16).lookup(torch.tensor([3]))
    keys = torch.zeros(4, kv_heads, head_dim, dtype=torch.bfloat16)
    qkv = torch.zeros(1, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        layer_ops.rope_and_cache(qkv, cos, sin, keys, keys.clone(), torch.tensor([4]), heads, kv_heads)
