"""Weight matrices held in GGUF's Q4_1 / Q8_0 block formats when that loses nothing, and their product kernel.

The default model is imported from a GGUF whose layer matrices are Q4_1 (blocks of 32 weights along the
input: ``w = d * q + m``, fp16 ``d`` and ``m``, ``q`` in 0..15) and whose embedding is Q8_0 (``w = d * q``,
``q`` int8). gguf-py dequantizes them in fp32 (the fp16 scales widened, then ``d * q``, then ``+ m``), so
each fp32 weight the engine reads is exactly such a block value. :func:`pack_lossless` recovers ``d``, ``m``
and ``q`` for every block of a matrix and keeps the packed form only if the kernel's own decoding gives the
fp32 matrix back bit for bit; any other matrix stays dense. A packed matrix is 5 (Q4_1) or 8.5 (Q8_0) bits a
weight instead of 32, so a decode step, which reads every weight once, moves a fraction of the bytes.

:meth:`PackedMatrix.linear` runs the C++ kernel (``csrc/packed_linear.cpp``, built by
``engine.models.extension``); :func:`reference_linear` is the pure-torch definition (decode, then
``F.linear``) the kernel is tested against. The products differ only in summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models.extension import extension_ready

SOURCE = Path(__file__).with_name("csrc") / "packed_linear.cpp"
NAME = "weir_packed_linear"
BLOCK = 32  # weights per block along the input dimension
ENCODE_ROWS = 4096  # rows encoded at a time (bounds the encoder's temporary memory)


@dataclass(frozen=True)
class PackedMatrix:
    """A [n, k] matrix in blocks of 32 along k: Q4_1 (``m`` set: ``q`` uint8 [n, k/2], two 4-bit values
    a byte, element i low and i + 16 high) or Q8_0 (``m`` None: ``q`` int8 [n, k]); ``d`` and ``m`` fp16
    [n, k/32]."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def format(self) -> str:
        return "Q4_1" if self.m is not None else "Q8_0"

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.d.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x`` [..., k] (fp32 or bf16) by the kernel (which must be available), in
        ``x``'s dtype: the kernel computes in fp32, so a bf16 ``x`` (and bias) is widened and the product
        rounded back."""
        out = torch.ops.weir_quant.packed_linear(x.reshape(-1, x.shape[-1]), self.q, self.d, self.m, bias)
        return out.view(*x.shape[:-1], self.shape[0])

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix, decoded by the kernel's own code."""
        return torch.ops.weir_quant.packed_dequantize(self.q, self.d, self.m)


@dataclass(frozen=True)
class Packed:
    """A packed matrix and the largest step (in rows) it runs; larger steps take the dense weight."""

    matrix: PackedMatrix
    max_rows: int

    def runs(self, rows: int) -> bool:
        return 0 < rows <= self.max_rows


def packed_kernel_available() -> bool:
    """Build (first time only) and load the kernel; False, with a warning logged once, if that fails or it
    was compiled without F16C and AVX-512 or AVX2 + FMA (its scalar loop is no faster than the dense path)."""
    what, fallback = "packed weight kernel", "dense layers keep their fp32 weights"
    return extension_ready(NAME, SOURCE, what, fallback, lambda: bool(torch.ops.weir_quant.simd()))


def reference_dequantize(packed: PackedMatrix) -> torch.Tensor:
    """The fp32 matrix in pure torch: ``d * q + m`` (``d * q`` is exact, so one rounding, as the kernel)."""
    n, k = packed.shape
    if packed.m is None:
        q = packed.q.view(n, k // BLOCK, BLOCK).float()
    else:
        pairs = packed.q.view(n, k // BLOCK, BLOCK // 2)
        q = torch.cat([pairs & 0x0F, pairs >> 4], dim=-1).float()
    w = packed.d.float().unsqueeze(-1) * q
    if packed.m is not None:
        w = w + packed.m.float().unsqueeze(-1)
    return w.view(n, k)


def reference_linear(x: torch.Tensor, packed: PackedMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What :meth:`PackedMatrix.linear` computes: the decoded matrix through ``F.linear``."""
    return F.linear(x, reference_dequantize(packed), bias)


def pack_lossless(weight: torch.Tensor) -> PackedMatrix | None:
    """``weight`` packed as Q4_1, else Q8_0, when the kernel decodes it back bit for bit; else None (also
    where the kernel is not available: the check decodes with its code)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or not weight.numel():
        return None
    if not packed_kernel_available():
        return None
    for encode in (_encode_q4_1, _encode_q8_0):
        packed = _encode(weight.contiguous(), encode)
        if packed is not None and _same_bits(packed.dequantize(), weight):
            return packed
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _encode(weight: torch.Tensor, encode) -> PackedMatrix | None:  # noqa: ANN001 (one of the encoders below)
    """Encode ``weight`` ENCODE_ROWS rows at a time; None as soon as a block is not representable."""
    parts = []
    for rows in weight.split(ENCODE_ROWS):
        part = encode(rows.view(rows.shape[0], -1, BLOCK))
        if part is None:
            return None
        parts.append(part)
    q, d, m = (torch.cat(list(ts)) if ts[0] is not None else None for ts in zip(*parts, strict=True))
    return PackedMatrix(q=q, d=d, m=m)


def _fp16_candidates(value: torch.Tensor) -> list[torch.Tensor]:
    """``value`` rounded to fp16, then its fp16 neighbours (scales are tried nearest first)."""
    nearest = value.half()
    bits = nearest.view(torch.int16)
    return [nearest] + [(bits + step).view(torch.float16) for step in (1, -1, 2, -2)]


def _encode_q4_1(blocks: torch.Tensor):  # noqa: ANN202 (q, d, m) or None
    """Q4_1 codes of [rows, nb, 32] fp32 blocks: the minimum is ``m`` (its element has q = 0), ``d`` the
    fp16 scale near (max - min) / 15 that reproduces every element; None if some block has none."""
    low = blocks.amin(-1)
    m = low.half()
    if not torch.equal(m.float(), low):
        return None
    span = (blocks.amax(-1) - low) / 15
    return _search_scales(blocks, span, m, 0, 15)


def _encode_q8_0(blocks: torch.Tensor):  # noqa: ANN202 (q, d, None) or None
    """Q8_0 codes of [rows, nb, 32] fp32 blocks: ``d`` the fp16 scale near max |w| / 127 that reproduces
    every element; None if some block has none."""
    return _search_scales(blocks, blocks.abs().amax(-1) / 127, None, -128, 127)


def _search_scales(blocks: torch.Tensor, estimate: torch.Tensor, m: torch.Tensor | None, lo: int, hi: int):  # noqa: ANN202
    """Try the fp16 scales near ``estimate`` per block; (q, d, m) once every block decodes exactly. Blocks
    the nearest scale does not reproduce (rare) are retried alone with its neighbours."""
    offset = m.float().unsqueeze(-1) if m is not None else None
    shifted = blocks if offset is None else blocks - offset
    candidates = _fp16_candidates(estimate)
    d = candidates[0]
    q, exact = _codes(blocks, shifted, d.float().unsqueeze(-1), offset, lo, hi)
    missing = (~exact).nonzero(as_tuple=True)
    for candidate in candidates[1:]:
        if not missing[0].numel():
            break
        subset = (blocks[missing], shifted[missing], candidate[missing].float().unsqueeze(-1))
        codes, ok = _codes(*subset, None if offset is None else offset[missing], lo, hi)
        found = tuple(index[ok] for index in missing)
        q[found], d[found] = codes[ok], candidate[found]
        missing = tuple(index[~ok] for index in missing)
    if missing[0].numel():
        return None
    rows = blocks.shape[0]
    if m is None:
        return q.to(torch.int8).view(rows, -1), d, None
    codes = q.to(torch.uint8)
    half = BLOCK // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).view(rows, -1), d, m


def _codes(
    blocks: torch.Tensor,
    shifted: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    lo: int,
    hi: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes of ``blocks`` at ``scale`` (a zero scale gives code 0) and which blocks they reproduce."""
    codes = shifted.div(scale).round_().nan_to_num_(0.0).clamp_(lo, hi)
    decoded = codes * scale
    if offset is not None:
        decoded += offset
    return codes, (decoded.view(torch.int32) == blocks.view(torch.int32)).all(-1)
