"""The tiled bf16 product (``brgemm`` kernel) against exact and fp32 references, and its row handling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.dense import Dense, KernelPlan, available_kernels
from engine.models.extension import cpu_flags
from engine.models.tile_linear import tile_kernel_available, tile_linear, tile_prepare

CPU = torch.device("cpu")


def _available() -> bool:
    """Whether the kernel runs here; a CPU with AMX must have it (where it does not, it is not offered)."""
    available = tile_kernel_available(CPU, torch.bfloat16)
    assert ("brgemm" in available_kernels(CPU, torch.bfloat16)) == available
    if not available:
        assert "amx_bf16" not in cpu_flags()
    return available


def _small_integers(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 5, 31, 33, 64, 65, 130, 300])
@pytest.mark.parametrize("outputs", [32, 40, 100])
def test_products_of_small_integers_are_exact_at_every_row_count(rows: int, outputs: int) -> None:
    """Small integers and their sums are exact in bf16 and fp32: a misplaced row, column or block shows."""
    if not _available():
        return
    x, w = _small_integers((rows, 96), rows), _small_integers((outputs, 96), outputs)
    bias = _small_integers((outputs,), 7)
    expected = x.float() @ w.float().T
    assert torch.equal(tile_linear(x, tile_prepare(w), None).float(), expected)
    assert torch.equal(tile_linear(x, tile_prepare(w), bias).float(), expected + bias.float())


@pytest.mark.parametrize("rows", [3, 17, 200])
def test_random_products_round_the_fp32_product(rows: int) -> None:
    if not _available():
        return
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 576, generator=generator).to(torch.bfloat16)  # a 3-D input keeps its shape
    w = torch.randn(200, 576, generator=generator).to(torch.bfloat16)
    bias = torch.randn(200, generator=generator).to(torch.bfloat16)
    got = tile_linear(x, tile_prepare(w), bias)
    assert got.shape == (2, rows, 200) and got.dtype == torch.bfloat16
    reference = F.linear(x.float(), w.float(), bias.float())  # summed in another order: a bf16 rounding apart
    torch.testing.assert_close(got.float(), reference, rtol=2**-7, atol=1e-2)


def test_bad_shapes_are_refused() -> None:
    if not _available():
        return
    with pytest.raises(RuntimeError, match="even number of inputs"):
        tile_prepare(torch.zeros(32, 7, dtype=torch.bfloat16))
    weight = tile_prepare(torch.zeros(32, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="features"):
        tile_linear(torch.zeros(2, 6, dtype=torch.bfloat16), weight, None)
    with pytest.raises(RuntimeError, match="bf16"):
        tile_linear(torch.zeros(2, 8), weight, None)


def test_the_tiled_kernel_runs_every_row_count_unpadded() -> None:
    """Nothing is compiled per row count, so no step pads its rows for this kernel (oneDNN's are rounded)."""
    if not _available():
        return
    dense = Dense(torch.randn(64, 32, dtype=torch.bfloat16), None, KernelPlan(((1, "brgemm"),)))
    assert set(dense.forms) == {"brgemm"}
    assert [dense.rows_to_run(rows) for rows in (1, 3, 17, 65, 301)] == [1, 3, 17, 65, 301]
    x = torch.randn(17, 32, dtype=torch.bfloat16)
    assert dense(x).shape == (17, 64)
