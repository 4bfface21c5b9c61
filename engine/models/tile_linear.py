"""bf16 matrix products over weights stored in column tiles (``csrc/tile_linear.cpp``): the ``brgemm``
kernel of ``engine.models.dense`` (oneDNN's small-matrix kernel) and its ``dot`` kernel (our own loop over
the AVX512-BF16 dot-product instruction, on the same tiles).

At a decode batch's few rows a product is bound by reading its weight, and oneDNN's linear primitive streamed
the weights of SmolLM2's layers at 14-19 GB/s on the AMX Xeon where this kernel streams them at 18-22. It
also runs any row count as it comes: oneDNN's primitive is compiled per row count, so the engine pads a
step's rows to a bounded set of counts for it (``dense``'s module note), and that padding costs a dozen
small torch calls per product. Where the extension cannot be built, or oneDNN's kernel does not multiply
exactly here, the kernel is simply not offered.

The ``dot`` kernel keeps every sum of up to ten rows by a block in registers and reads each weight vector
once for all of them (the source's note); on an AVX512-BF16 EPYC it ran SmolLM2's products 10-25 % faster
than oneDNN's kernel at a decode batch's 8-64 rows and 3-6 % faster at 128-512. It is offered where the
extension was built with that instruction and multiplies the probe exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from engine.models.extension import extension_ready

SOURCE = Path(__file__).with_name("csrc") / "tile_linear.cpp"
NAME = "weir_tile_linear"


@dataclass(frozen=True)
class TiledWeight:
    """A [outputs, inputs] bf16 weight in the kernel's layout (column blocks, pair-interleaved inputs)."""

    tiles: torch.Tensor
    outputs: int


def tile_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel runs ``dtype`` on ``device``: bf16 on a CPU, built, exact on a probe product."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    what, fallback = "tiled bf16 matrix products", "products keep oneDNN's and aten's"
    return extension_ready(NAME, SOURCE, what, fallback, lambda: _exact_on_a_probe(tile_linear))


def dot_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the ``dot`` kernel runs ``dtype`` on ``device``: the tiled kernel's extension, built for a
    CPU with AVX512-BF16, exact on a probe product."""
    return tile_kernel_available(device, dtype) and _dot_exact()


@cache
def _dot_exact() -> bool:
    return bool(torch.ops.weir_tiles.has_dot()) and _exact_on_a_probe(dot_linear)


Apply = Callable[[torch.Tensor, TiledWeight, torch.Tensor | None], torch.Tensor]


def _exact_on_a_probe(apply: Apply) -> bool:
    # small integers are exact in bf16 and in fp32 sums, so a working kernel gives the product bit for bit
    x = (torch.arange(13 * 6) % 7 - 3).view(13, 6).to(torch.bfloat16)
    w = (torch.arange(40 * 6) % 5 - 2).view(40, 6).to(torch.bfloat16)
    bias = torch.arange(40, dtype=torch.bfloat16)
    try:
        got = apply(x, tile_prepare(w), bias)
    except RuntimeError:
        return False
    return bool(torch.equal(got.float(), x.float() @ w.float().T + bias.float()))


def tile_prepare(weight: torch.Tensor) -> TiledWeight:
    return TiledWeight(torch.ops.weir_tiles.tile_pack(weight), weight.shape[0])


def tile_linear(x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for bf16 ``x`` [..., inputs]: fp32 sums, rounded once to bf16."""
    return torch.ops.weir_tiles.tile_linear(x, weight.tiles, bias, weight.outputs)


def dot_linear(x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``tile_linear`` by the ``dot`` kernel: the same product, summed in the same order."""
    return torch.ops.weir_tiles.dot_linear(x, weight.tiles, bias, weight.outputs)
