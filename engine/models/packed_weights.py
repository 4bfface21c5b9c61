"""Which of a model's matrices run packed (``engine.models.packed``), and up to how many rows.

At load, for an fp32 or bf16 model on a CPU where the packed kernel runs, every projection matrix and the
logits projection are packed where that is lossless (from the checkpoint's fp32 values, read once more
for a bf16 model; the kernel then widens bf16 activations to fp32 and rounds its products back). The
packed kernel reads 5 or 8.5 bits a weight and wins on decode steps, which are bound by reading the
weights; a dense GEMM wins once enough rows share each weight read. So the crossover is measured on the
model's own matrices, packed against dense, at ``ROWS``: for each kind of matrix (the four projections,
the logits projection) one product with every layer's matrix, so that the weights stream from memory as
in a step (one layer's would sit in the cache), and each kind runs packed for steps of at most the largest
measured row count up to which the packed products were faster at every count; the figures are logged.

``$WEIR_PACKED_WEIGHTS`` overrides the choice: ``off`` keeps every matrix dense, a number packs (where
lossless) up to that many rows without measuring, ``auto`` (the default) measures.

Both forms are kept: prefill steps run the dense weights, so the packed copies add their size (about a fifth
of the fp32 weights for Q4_1, two fifths of bf16) to the model's memory.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.models.dense import ROLES
from engine.models.dtype_choice import fastest_seconds
from engine.models.loader import ModelWeights
from engine.models.packed import Packed, PackedMatrix, pack_lossless, packed_kernel_available

log = logging.getLogger("weir.engine")

PACKED_ENV = "WEIR_PACKED_WEIGHTS"
ROWS = (1, 4, 16, 64)  # row counts timed, ascending; timing stops at the first the packed loses
REPEATS = 3  # the fastest of this many runs counts
DTYPES = (torch.float32, torch.bfloat16)  # the model dtypes that can run packed
Product = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PackedLayer:
    qkv: Packed | None
    out: Packed | None
    gate_up: Packed | None
    down: Packed | None


@dataclass(frozen=True)
class PackedWeights:
    """The packed forms of a model's matrices (None where a matrix stays dense only)."""

    layers: list[PackedLayer]
    lm_head: Packed | None

    @property
    def nbytes(self) -> int:
        packed = [p for layer in self.layers for p in vars(layer).values() if p] + [self.lm_head]
        return sum(p.matrix.nbytes for p in packed if p)


def packed_setting() -> int | None:
    """``$WEIR_PACKED_WEIGHTS`` as a row limit: None for ``auto`` (measure), 0 for ``off``."""
    value = os.environ.get(PACKED_ENV, "auto").strip().lower()
    if value == "auto":
        return None
    if value == "off":
        return 0
    if value.isdigit():
        return int(value)
    raise ValueError(f"{PACKED_ENV} must be auto, off or a row count, got {value!r}")


def pack_weights(
    fp32_weights: Callable[[], ModelWeights],
    device: torch.device,
    dtype: torch.dtype,
    dense: dict[str, list[Product]],
) -> PackedWeights | None:
    """The packed forms of the model's weights (read by ``fp32_weights``: packing needs their exact fp32
    values, which a bf16 copy has lost) with their row limits, or None when nothing runs packed (not an fp32
    or bf16 CPU model, ``off``, no kernel, no matrix packs losslessly, or packing measured slower).
    ``dense`` holds, per role (``ROLES`` and ``lm_head``), the product that runs each layer's matrix
    otherwise, in ``dtype``: what the packed kernel is timed against."""
    setting = packed_setting()
    if setting == 0 or device.type != "cpu" or dtype not in DTYPES or not packed_kernel_available():
        return None
    started = time.perf_counter()
    weights = fp32_weights()
    matrices = [{role: pack_lossless(getattr(layer, role)) for role in ROLES} for layer in weights.layers]
    head = pack_lossless(weights.lm_head)
    found = [m for m in (*(m for layer in matrices for m in layer.values()), head) if m is not None]
    if not found:
        log.info("packed weights: no matrix is exactly Q4_1 or Q8_0; all stay dense")
        return None
    limits = {role: setting for role in (*ROLES, "lm_head")} if setting else None
    if limits is None:
        packed_by_role = {role: [layer[role] for layer in matrices] for role in ROLES} | {"lm_head": [head]}
        limits = {role: _measured_limit(role, dense[role], packed_by_role[role], dtype) for role in dense}

    def limited(matrix: PackedMatrix | None, role: str) -> Packed | None:
        return Packed(matrix, limits[role]) if matrix is not None and limits[role] > 0 else None

    result = PackedWeights(
        layers=[PackedLayer(**{role: limited(layer[role], role) for role in ROLES}) for layer in matrices],
        lm_head=limited(head, "lm_head"),
    )
    log.info(
        "packed weights: %d of %d matrices lossless (%s), %.0f MB packed beside %.0f MB %s, in %.1f s;"
        " run packed up to %s rows",
        len(found),
        len(matrices) * len(ROLES) + 1,
        ", ".join(sorted({m.format for m in found})),
        result.nbytes / 1e6,
        _dense_bytes(weights) * dtype.itemsize / 4 / 1e6,
        str(dtype).removeprefix("torch."),
        time.perf_counter() - started,
        ", ".join(f"{role} {limit}" for role, limit in limits.items()),
    )
    return result if result.nbytes else None


def _dense_bytes(weights: ModelWeights) -> int:
    matrices = [getattr(layer, role) for layer in weights.layers for role in ROLES] + [weights.lm_head]
    return sum(m.numel() * m.element_size() for m in matrices)


def _measured_limit(
    role: str, dense: list[Product], packed: list[PackedMatrix | None], dtype: torch.dtype
) -> int:
    """The largest of ``ROWS`` up to which the packed matrices of ``role`` beat their dense products at every
    count (0: never), timed over every layer's matrix so that the weights come from memory as in a step;
    logged."""
    pairs = [(product, matrix) for product, matrix in zip(dense, packed, strict=True) if matrix is not None]
    if not pairs:
        return 0
    inputs = pairs[0][1].shape[1]
    limit, figures = 0, []
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, inputs, dtype=dtype)
            dense_s = fastest_seconds(lambda x=x: [product(x) for product, _ in pairs], REPEATS)
            packed_s = fastest_seconds(lambda x=x: [matrix.linear(x) for _, matrix in pairs], REPEATS)
            figures.append(f"{rows}: {dense_s * 1e3:.2f}/{packed_s * 1e3:.2f}")
            if packed_s >= dense_s:
                break
            limit = rows
    fmt, shape = pairs[0][1].format, pairs[0][1].shape
    log.info(
        "packed %s %s %s x %d (rows: dense/packed ms): %s", fmt, role, shape, len(pairs), ", ".join(figures)
    )
    return limit
