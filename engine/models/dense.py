"""The dense layers' matrix products, ``y = x @ W.T + b``, and which implementation runs each of them.

Four implementations of the same product, differing only in summation order:

- ``aten``: torch's ``F.linear`` on the weight as loaded (on CPU in fp32, MKL's GEMM).
- ``onednn``: the weight reordered once, at load, into oneDNN's blocked layout and multiplied by oneDNN's
  linear primitive (``torch.ops.mkldnn._linear_pointwise``, what ``torch.compile`` uses for packed CPU
  linears). MKL's GEMM runs a few rows at a fraction of the memory bandwidth on some CPUs (on a 2-core AMD
  EPYC: 8 rows of the 49152x576 logits projection at 3.5 GB/s), where oneDNN's runs 2-3x faster.
- ``brgemm``: bf16 only, the weight in column tiles multiplied by oneDNN's small-matrix kernel
  (``engine.models.tile_linear``); faster than the linear primitive at a decode batch's rows, and run at any
  row count unpadded.
- ``dot``: bf16 on a CPU with AVX512-BF16, the same tiles (one copy serves both) multiplied by our own
  register-tiled loop over the dot-product instruction, in the same order as ``brgemm``'s AVX512-BF16 path.

None wins at every row count on every machine, so a :class:`KernelPlan`, chosen by measurement at load
(``dtype_choice``), names the kernel per range of row counts, and each :class:`Dense` keeps the weight in
just the forms its plan uses.

oneDNN compiles a primitive for every row count it meets and keeps it (about half a MiB each, in ideep's
and oneDNN's caches of 1024 entries); a miss costs about a millisecond. That holds for the ``onednn``
kernel and for ``aten``'s 16-bit products on a CPU, which go through oneDNN too. An engine step's row count
is its token count, which varies from step to step, so such products run a multiple of
``SHAPE_ROW_MULTIPLE`` rows: a server then meets a bounded set of shapes early and its memory stays level.
Decode batches (up to ``SMALL_ROWS`` rows) round to the finer ``SMALL_ROW_MULTIPLE``: their products take
time in proportion to the rows, and padding 17 decodes to 32 cost nearly half of such a step's products,
where the finer rounding adds a dozen row counts per matrix shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.packed import Packed
from engine.models.tile_linear import (
    dot_kernel_available,
    dot_linear,
    tile_kernel_available,
    tile_linear,
    tile_prepare,
)

ROLES = ("qkv", "out", "gate_up", "down")  # a decoder layer's products
SHAPE_ROW_MULTIPLE = 16
SMALL_ROWS = 64  # up to this many rows, products round to SMALL_ROW_MULTIPLE instead
SMALL_ROW_MULTIPLE = 4

Prepare = Callable[[torch.Tensor], object]  # the weight in the form the kernel reads
Apply = Callable[[torch.Tensor, object, torch.Tensor | None], torch.Tensor]


def _onednn_prepare(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _onednn_apply(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _aten_prepare(weight: torch.Tensor) -> torch.Tensor:
    return weight


KERNELS: dict[str, tuple[Prepare, Apply]] = {
    "aten": (_aten_prepare, F.linear),
    "onednn": (_onednn_prepare, _onednn_apply),
    "brgemm": (tile_prepare, tile_linear),
    "dot": (tile_prepare, dot_linear),
}


def available_kernels(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels that run ``dtype`` on ``device`` here (oneDNN's only on a CPU whose build has it; the
    tiled kernels for bf16 where their extension works)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return ("aten",)
    tiles = ("brgemm",) if tile_kernel_available(device, dtype) else ()
    tiles += ("dot",) if dot_kernel_available(device, dtype) else ()
    try:
        probe = torch.ones(4, 8, dtype=dtype)
        ok = bool(
            torch.allclose(
                _onednn_apply(probe, _onednn_prepare(probe), None).float(), probe.float() @ probe.float().T
            )
        )
    except RuntimeError:
        ok = False
    return (("aten", "onednn") if ok else ("aten",)) + tiles


@dataclass(frozen=True)
class KernelPlan:
    """The kernel for each range of row counts: ``(up_to_rows, kernel)`` in ascending order; the last entry
    also covers every larger count."""

    steps: tuple[tuple[int, str], ...] = ((1, "aten"),)

    @classmethod
    def from_measured(cls, rows: tuple[int, ...], fastest: tuple[str, ...]) -> KernelPlan:
        """A plan from the fastest kernel measured at each of ``rows`` (ascending): a measured count's
        kernel runs the counts up to the geometric midpoint with the next one."""
        limits = [int((a * b) ** 0.5) for a, b in zip(rows, rows[1:], strict=False)] + [rows[-1]]
        merged: list[tuple[int, str]] = []
        for limit, name in zip(limits, fastest, strict=True):
            if merged and merged[-1][1] == name:
                merged[-1] = (limit, name)
            else:
                merged.append((limit, name))
        return cls(tuple(merged))

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for _, name in self.steps))

    def kernel_for(self, rows: int) -> str:
        return next((name for limit, name in self.steps if rows <= limit), self.steps[-1][1])

    def describe(self) -> str:
        if len(self.steps) == 1:
            return self.steps[0][1]
        bounds = [f"{name} up to {limit} rows" for limit, name in self.steps[:-1]]
        return ", ".join([*bounds, f"{self.steps[-1][1]} above"])


class Dense:
    """One weight matrix and its bias, held in the forms its plan uses."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: KernelPlan) -> None:
        self.plan = plan
        self.bias = bias
        self.out_features = weight.shape[0]
        preparers = {name: KERNELS[name][0] for name in plan.kernels}
        prepared = {prepare: prepare(weight) for prepare in set(preparers.values())}  # one copy per form
        self.forms = {name: prepared[prepare] for name, prepare in preparers.items()}
        self.packed: Packed | None = None  # a packed copy for small steps (``packed_weights``)
        self._onednn_aten = weight.device.type == "cpu" and weight.dtype != torch.float32

    def rows_to_run(self, rows: int) -> int:
        """The row count to run ``rows`` rows at: rounded up to ``SMALL_ROW_MULTIPLE`` (up to ``SMALL_ROWS``
        rows) or ``SHAPE_ROW_MULTIPLE`` where the kernel keeps a primitive per row count (see the module's
        note)."""
        if self.runs_packed(rows):
            return rows
        name = self.plan.kernel_for(rows)
        if name == "onednn" or (name == "aten" and self._onednn_aten):
            multiple = SMALL_ROW_MULTIPLE if rows <= SMALL_ROWS else SHAPE_ROW_MULTIPLE
            return -(-rows // multiple) * multiple
        return rows

    def runs_packed(self, rows: int) -> bool:
        return self.packed is not None and self.packed.runs(rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_packed(x.shape[0]):
            return self.packed.matrix.linear(x, self.bias)
        name = self.plan.kernel_for(x.shape[0])
        return KERNELS[name][1](x, self.forms[name], self.bias)
