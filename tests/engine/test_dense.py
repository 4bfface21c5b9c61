"""The dense layers' kernels compute the same products, and the plan picks one per row count as measured."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.dense import (
    SHAPE_ROW_MULTIPLE,
    SMALL_ROW_MULTIPLE,
    SMALL_ROWS,
    Dense,
    KernelPlan,
    available_kernels,
)


@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_every_available_kernel_computes_the_linear_product(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 24, generator=generator)
    b = torch.randn(37, generator=generator) if bias else None
    x = torch.randn(rows, 24, generator=generator)
    kernels = available_kernels(torch.device("cpu"), torch.float32)
    assert "aten" in kernels
    for name in kernels:
        got = Dense(weight, b, KernelPlan(((1, name),)))(x)
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_a_plan_runs_each_row_count_with_the_kernel_measured_fastest_nearest_to_it() -> None:
    plan = KernelPlan.from_measured((1, 16, 256), ("aten", "onednn", "onednn"))
    assert plan.steps == ((4, "aten"), (256, "onednn"))  # 1 row's kernel up to sqrt(1 * 16) rows
    assert [plan.kernel_for(rows) for rows in (1, 4, 5, 64, 65, 4096)] == [
        "aten",
        "aten",
        "onednn",
        "onednn",
        "onednn",
        "onednn",
    ]
    mixed = KernelPlan.from_measured((1, 16, 256), ("onednn", "aten", "onednn"))
    assert mixed.steps == ((4, "onednn"), (64, "aten"), (256, "onednn"))
    assert [mixed.kernel_for(rows) for rows in (4, 5, 64, 65, 1000)] == [
        "onednn",
        "aten",
        "aten",
        "onednn",
        "onednn",
    ]
    assert mixed.kernels == ("onednn", "aten")


@pytest.mark.parametrize("kernel", ["aten", "onednn"])
def test_a_matrix_keeps_only_the_forms_its_plan_uses(kernel: str) -> None:
    if kernel not in available_kernels(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build's oneDNN does not run float32 products on this CPU")
    assert set(Dense(torch.randn(8, 8), None, KernelPlan(((1, kernel),))).forms) == {kernel}


def test_products_through_onednn_run_a_bounded_set_of_row_counts() -> None:
    """oneDNN keeps a compiled primitive per row count, so its products round rows up; MKL's fp32 does not."""
    fp32, bf16 = torch.randn(8, 8), torch.randn(8, 8, dtype=torch.bfloat16)
    mixed = KernelPlan(((4, "aten"), (256, "onednn")))
    rows = (1, 4, 5, 16, 17, SMALL_ROWS, SMALL_ROWS + 1, 300)
    assert [Dense(fp32, None, mixed).rows_to_run(count) for count in rows] == [
        1,
        4,
        2 * SMALL_ROW_MULTIPLE,
        16,
        5 * SMALL_ROW_MULTIPLE,
        SMALL_ROWS,
        SMALL_ROWS + SHAPE_ROW_MULTIPLE,
        19 * SHAPE_ROW_MULTIPLE,
    ]
    aten = KernelPlan(((1, "aten"),))
    assert [Dense(fp32, None, aten).rows_to_run(count) for count in (3, 17)] == [3, 17]
    assert [Dense(bf16, None, aten).rows_to_run(count) for count in (3, 17, 100)] == [4, 20, 112]
