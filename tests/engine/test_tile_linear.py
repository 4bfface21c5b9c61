"""The tiled bf16 products (``brgemm`` and ``dot`` kernels) against exact and fp32 references and each
other, and their row handling."""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.nn.functional as F

from engine.models.dense import Dense, KernelPlan, available_kernels
from engine.models.extension import cpu_flags
from engine.models.tile_linear import (
    dot_kernel_available,
    dot_linear,
    tile_kernel_available,
    tile_linear,
    tile_prepare,
)

CPU = torch.device("cpu")
KERNELS = {"brgemm": tile_linear, "dot": dot_linear}


# The CPU features each kernel needs (any one of them): oneDNN's small-matrix kernel runs on AMX or
# AVX512-BF16, the dot kernel is built with AVX512-BF16.
FEATURES = {"brgemm": ("amx_bf16", "avx512_bf16"), "dot": ("avx512_bf16",)}


@cache
def _missing(kernel: str) -> str | None:
    """Why ``kernel`` does not run here (the CPU features it lacks), or None where it runs; a CPU with one of
    its features must run it (where a kernel does not run, it is not offered)."""
    available = (tile_kernel_available if kernel == "brgemm" else dot_kernel_available)(CPU, torch.bfloat16)
    assert (kernel in available_kernels(CPU, torch.bfloat16)) == available
    if available:
        return None
    present = [flag for flag in FEATURES[kernel] if flag in cpu_flags()]
    assert not present, f"the {kernel} kernel does not run on this CPU with {present}: did its build fail?"
    return f"the {kernel} kernel needs {' or '.join(FEATURES[kernel])}, which this CPU lacks"


def _require(kernel: str = "brgemm") -> None:
    """Skip the test where ``kernel`` does not run, naming the CPU feature missing."""
    reason = _missing(kernel)
    if reason is not None:
        pytest.skip(reason)


def _small_integers(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 9, 10, 11, 31, 33, 64, 65, 130, 300])
@pytest.mark.parametrize("outputs", [32, 40, 100])
def test_small_integer_products_are_exact_at_every_row_count(kernel: str, rows: int, outputs: int) -> None:
    """Small integers and their sums are exact in bf16 and fp32: a misplaced row, column or block shows."""
    _require(kernel)
    x, w = _small_integers((rows, 96), rows), _small_integers((outputs, 96), outputs)
    bias = _small_integers((outputs,), 7)
    expected = x.float() @ w.float().T
    assert torch.equal(KERNELS[kernel](x, tile_prepare(w), None).float(), expected)
    assert torch.equal(KERNELS[kernel](x, tile_prepare(w), bias).float(), expected + bias.float())


@pytest.mark.parametrize("rows", [1, 8, 10, 21, 32, 77])
def test_the_dot_kernel_sums_as_onednns_avx512_kernel_does(rows: int) -> None:
    """Without AMX, oneDNN's kernel sums each output pair by pair in input order, as the dot kernel does:
    the two agree bit for bit on random products (with AMX they may differ in the last bit)."""
    _require("dot")
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1536, generator=generator).to(torch.bfloat16)
    w = tile_prepare(torch.randn(100, 1536, generator=generator).to(torch.bfloat16))
    bias = torch.randn(100, generator=generator).to(torch.bfloat16)
    for b in (None, bias):
        got, oned = dot_linear(x, w, b), tile_linear(x, w, b)
        if "amx_bf16" in cpu_flags():
            torch.testing.assert_close(got.float(), oned.float(), rtol=2**-7, atol=1e-2)
        else:
            assert torch.equal(got, oned)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [3, 17, 200])
def test_random_products_round_the_fp32_product(kernel: str, rows: int) -> None:
    _require(kernel)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 576, generator=generator).to(torch.bfloat16)  # a 3-D input keeps its shape
    w = torch.randn(200, 576, generator=generator).to(torch.bfloat16)
    bias = torch.randn(200, generator=generator).to(torch.bfloat16)
    got = KERNELS[kernel](x, tile_prepare(w), bias)
    assert got.shape == (2, rows, 200) and got.dtype == torch.bfloat16
    reference = F.linear(x.float(), w.float(), bias.float())  # summed in another order: a bf16 rounding apart
    torch.testing.assert_close(got.float(), reference, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_shapes_are_refused(kernel: str) -> None:
    _require(kernel)
    with pytest.raises(RuntimeError, match="even number of inputs"):
        tile_prepare(torch.zeros(32, 7, dtype=torch.bfloat16))
    weight = tile_prepare(torch.zeros(32, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="features"):
        KERNELS[kernel](torch.zeros(2, 6, dtype=torch.bfloat16), weight, None)
    with pytest.raises(RuntimeError, match="bf16"):
        KERNELS[kernel](torch.zeros(2, 8), weight, None)


def test_the_tiled_kernel_runs_every_row_count_unpadded() -> None:
    """Nothing is compiled per row count, so no step pads its rows for this kernel (oneDNN's are rounded)."""
    _require()
    dense = Dense(torch.randn(64, 32, dtype=torch.bfloat16), None, KernelPlan(((1, "brgemm"),)))
    assert set(dense.forms) == {"brgemm"}
    assert [dense.rows_to_run(rows) for rows in (1, 3, 17, 65, 301)] == [1, 3, 17, 65, 301]
    x = torch.randn(17, 32, dtype=torch.bfloat16)
    assert dense(x).shape == (17, 64)


def test_the_two_tiled_kernels_share_one_copy_of_the_weight() -> None:
    """A plan that mixes ``brgemm`` and ``dot`` keeps the tiles once (the two read the same layout)."""
    _require("dot")
    weight = torch.randn(64, 32, dtype=torch.bfloat16)
    dense = Dense(weight, None, KernelPlan(((16, "dot"), (64, "brgemm"))))
    assert dense.forms["dot"] is dense.forms["brgemm"]
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    assert torch.equal(dense(x[:5]), dot_linear(x[:5], dense.forms["dot"], None))
    assert torch.equal(dense(x), tile_linear(x, dense.forms["brgemm"], None))
