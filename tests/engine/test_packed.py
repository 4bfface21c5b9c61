"""Packed Q4_1 / Q8_0 weights: the C++ kernel against the pure-torch reference, the lossless check, and the
engine's greedy output with packing on and off (a tiny Llama with block-representable weights, SmolLM2)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models import load_model
from engine.models.extension import cpu_flags
from engine.models.packed import (
    BLOCK,
    PackedMatrix,
    pack_lossless,
    packed_kernel_available,
    reference_dequantize,
    reference_linear,
)
from engine.models.packed_weights import PACKED_ENV, ROWS, PackedWeights, packed_setting
from engine.tokenizer import Tokenizer
from tests.engine.test_model_interface import one_prompt
from tests.fixtures.models import paged_greedy

# The instruction sets the kernel has a vector loop for (without one it is not offered).
SIMD_FEATURES = ({"avx512f", "f16c"}, {"avx2", "fma", "f16c"})


@pytest.fixture(scope="module", autouse=True)
def packed_kernel() -> None:
    """Skip where the CPU has none of the kernel's instruction sets; where it has one, the kernel must build
    and load (a failed build is a failure, not a skip)."""
    if not any(features <= cpu_flags() for features in SIMD_FEATURES):
        pytest.skip("the packed kernel needs F16C with AVX-512F or with AVX2 and FMA, which this CPU lacks")
    assert packed_kernel_available(), (
        "the packed kernel did not build or load on a CPU it supports (see the log)"
    )


SHAPES = ((1, 32), (7, 96), (33, 160), (960, 576), (5, 1536))  # (n, k): odd n, k not a multiple of 64
ROW_COUNTS = (1, 2, 3, 5, 8, 9, 17, 32)


def random_packed(n: int, k: int, fmt: str, seed: int = 0) -> PackedMatrix:
    """A random packed matrix whose every block uses its extreme codes (as a quantizer's output does)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = k // BLOCK
    d = (torch.rand(n, blocks, generator=gen) * 0.02 + 1e-3).half()
    if fmt == "Q8_0":
        q = torch.randint(-127, 128, (n, blocks, BLOCK), generator=gen, dtype=torch.int8)
        q[..., 0] = 127 * torch.where(torch.rand(n, blocks, generator=gen) < 0.5, -1, 1).to(torch.int8)
        return PackedMatrix(q=q.view(n, k), d=d, m=None)
    q = torch.randint(0, 16, (n, blocks, BLOCK), generator=gen, dtype=torch.uint8)
    q[..., 3], q[..., 20] = 0, 15
    m = (torch.randn(n, blocks, generator=gen) * 0.05).half()
    return PackedMatrix(q=(q[..., :16] | (q[..., 16:] << 4)).view(n, k // 2), d=d, m=m)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_same_product(got: torch.Tensor, x: torch.Tensor, packed: PackedMatrix, bias=None) -> None:  # noqa: ANN001
    """``got`` equals the reference product up to fp32 summation order: within a few units of rounding of
    the sum of the terms' magnitudes, element by element."""
    expected = reference_linear(x, packed, bias)
    magnitude = x.abs() @ reference_dequantize(packed).abs().T
    assert got.shape == expected.shape
    assert bool(((got - expected).abs() <= 2e-6 * magnitude + 1e-6).all())


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(fmt: str, shape: tuple[int, int]) -> None:
    n, k = shape
    packed = random_packed(n, k, fmt)
    assert packed.format == fmt and packed.shape == shape
    assert _same_bits(packed.dequantize(), reference_dequantize(packed))
    bias = torch.randn(n)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, k)
        for b in (None, bias):
            assert_same_product(packed.linear(x, b), x, packed, b)


def test_kernel_keeps_leading_dims_and_takes_non_contiguous_rows() -> None:
    packed = random_packed(33, 160, "Q4_1")
    x = torch.randn(2, 3, 320)[..., ::2]
    assert_same_product(packed.linear(x), x, packed)
    assert packed.linear(torch.empty(0, 160)).shape == (0, 33)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_lossless_packing_recovers_the_blocks(fmt: str) -> None:
    original = random_packed(65, 192, fmt, seed=3)
    weight = reference_dequantize(original)
    packed = pack_lossless(weight)
    assert packed is not None and packed.format == fmt
    assert _same_bits(packed.dequantize(), weight)
    assert packed.nbytes * 8 / weight.numel() == (5.0 if fmt == "Q4_1" else 8.5)


def test_lossless_check_rejects_what_blocks_cannot_hold() -> None:
    weight = reference_dequantize(random_packed(17, 96, "Q4_1", seed=5))
    nudged = weight.clone()
    nudged[9, 40] = torch.nextafter(nudged[9, 40], torch.tensor(1.0))  # one ulp off a block value
    assert pack_lossless(nudged) is None
    assert pack_lossless(torch.randn(8, 64)) is None  # plain fp32 weights
    assert pack_lossless(torch.randn(8, 48)) is None  # k not a multiple of the block
    assert pack_lossless(weight.bfloat16()) is None  # only fp32 is packed
    assert pack_lossless(weight) is not None


def test_setting_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expected in (("auto", None), ("off", 0), ("24", 24)):
        monkeypatch.setenv(PACKED_ENV, value)
        assert packed_setting() == expected
    monkeypatch.setenv(PACKED_ENV, "fast")
    with pytest.raises(ValueError, match=PACKED_ENV):
        packed_setting()


def _block_values(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """``weight`` rounded to the nearest values of the format (a quantizer and its fp32 decoding)."""
    n, k = weight.shape
    blocks = weight.view(n, k // BLOCK, BLOCK)
    if fmt == "Q8_0":
        d = (blocks.abs().amax(-1) / 127).half().float().unsqueeze(-1)
        q = torch.round(blocks / d).clamp(-127, 127)
        extreme = blocks.abs().argmax(-1, keepdim=True)
        q.scatter_(-1, extreme, 127 * blocks.gather(-1, extreme).sign())
        return (d * (q + 0.0)).view(n, k)  # + 0.0: a code rounded to -0 is the integer 0
    m = blocks.amin(-1).half().float().unsqueeze(-1)
    d = ((blocks.amax(-1, keepdim=True) - m) / 15).half().float()
    q = torch.round((blocks - m) / d).clamp(0, 15)
    q.scatter_(-1, blocks.argmin(-1, keepdim=True), 0.0)
    q.scatter_(-1, blocks.argmax(-1, keepdim=True), 15.0)
    return (d * q + m).view(n, k)


@pytest.fixture(scope="module")
def block_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its projections rounded to Q4_1 values and its embedding / head to Q8_0."""
    path = tmp_path_factory.mktemp("tiny-blocks")
    for file in tiny_model_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, path / file.name)
    for file in tiny_model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            if tensor.dim() == 2:
                fmt = "Q8_0" if "embed" in name or "lm_head" in name else "Q4_1"
                tensors[name] = _block_values(tensor, fmt).contiguous()
        save_file(tensors, path / file.name, metadata={"format": "pt"})
    return path


def _greedy_on_off(
    model_dir: Path,
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> tuple[list[list[int]], list[list[int]], PackedWeights]:
    monkeypatch.setenv(PACKED_ENV, "off")
    dense = load_model(model_dir)
    assert dense.packed is None
    monkeypatch.setenv(PACKED_ENV, "64")
    with caplog.at_level(logging.INFO, logger="weir.engine"):
        packed = load_model(model_dir)
    assert packed.packed is not None
    return (
        paged_greedy(dense, prompts, 16, chunk_size=16, block_size=16),
        paged_greedy(packed, prompts, 16, chunk_size=16, block_size=16),
        packed.packed,
    )


def _prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer(model_dir)
    questions = ("What is the capital of France?", "Write a haiku about the sea.", "List three colors.", "Hi")
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]


def test_tiny_model_greedy_is_the_same_packed(
    block_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    off, on, packed = _greedy_on_off(block_model_dir, _prompts(block_model_dir), monkeypatch, caplog)
    assert on == off
    assert all(p is not None for layer in packed.layers for p in vars(layer).values())
    assert packed.lm_head is not None and packed.lm_head.matrix.format == "Q8_0"
    assert packed.layers[0].qkv.matrix.format == "Q4_1"
    assert "9 of 9 matrices lossless" in caplog.text


@pytest.mark.parametrize("setting", ["64", "auto"])
def test_tiny_model_with_plain_weights_stays_dense(
    setting: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(PACKED_ENV, setting)
    with caplog.at_level(logging.INFO, logger="weir.engine"):
        assert load_model(tiny_model_dir).packed is None
    assert "all stay dense" in caplog.text


def test_auto_measures_and_logs_the_choice(
    block_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(PACKED_ENV, "auto")
    with caplog.at_level(logging.INFO, logger="weir.engine"):
        model = load_model(block_model_dir)
    assert "(rows: dense/packed ms): 1: " in caplog.text
    assert "run packed up to" in caplog.text
    chosen = [p for layer in model.packed.layers for p in vars(layer).values()] if model.packed else []
    assert all(p is None or p.max_rows in ROWS for p in [*chosen, model.packed and model.packed.lm_head])


def test_smollm2_greedy_is_the_same_packed(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    off, on, packed = _greedy_on_off(smollm2_dir, _prompts(smollm2_dir), monkeypatch, caplog)
    assert on == off
    assert "121 of 121 matrices lossless (Q4_1, Q8_0)" in caplog.text
    assert packed.lm_head.matrix.format == "Q8_0"


def test_a_bf16_model_packs_from_the_fp32_values(
    block_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bf16 model packs from the checkpoint's fp32 values (its bf16 copy has lost them): the packed
    product is the fp32 kernel's, rounded to bf16, and a step's logits stay within bf16 rounding of the
    dense bf16 model's."""
    monkeypatch.setenv(PACKED_ENV, "off")
    dense = load_model(block_model_dir, dtype="bfloat16")
    monkeypatch.setenv(PACKED_ENV, "64")
    with caplog.at_level(logging.INFO, logger="weir.engine"):
        packed = load_model(block_model_dir, dtype="bfloat16")
    assert dense.packed is None and packed.packed is not None
    assert "9 of 9 matrices lossless" in caplog.text and "MB bfloat16" in caplog.text
    matrix = packed.packed.layers[0].gate_up.matrix
    x = torch.randn(3, matrix.shape[1]).to(torch.bfloat16)
    out = matrix.linear(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, matrix.linear(x.float()).to(torch.bfloat16))
    batch = one_prompt([5, 6, 7, 8])  # 4 rows: within the packed limit
    logits = [m.forward(batch, m.new_kv_cache(2, 4)).float() for m in (dense, packed)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0.05, atol=0.05)
