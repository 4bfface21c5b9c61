"""``dtype="auto"``: the compute dtype in which this machine runs the model's own shapes fastest.

The dense layers are most of a step's time, so the choice times them: one layer's projections (QKV, output,
gate/up, down) scaled by the number of layers, plus the logits projection, at a single-sequence decode, a
decode batch and a prefill chunk, with random weights of the model's shapes. The score of a dtype is the
geometric mean of the three step times, so each kind of step counts alike. Some CPUs run bf16 several times
faster than fp32 at these shapes, others slower; fp16 and bf16 are also tried on CUDA.

Some CPU bf16 kernels are far slower for a handful of rows than for a few more, so the choice also measures
whether padding small batches to ``PAD_ROWS`` rows is faster, and says so in ``min_rows``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig

log = logging.getLogger("weir.engine")

ROWS = (1, 16, 256)  # a single decode, a decode batch, a prefill chunk
PAD_ROWS = 16
REPEATS = 3  # the fastest of this many runs counts
CANDIDATES = {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16", "float16", "float32")}


@dataclass(frozen=True)
class DtypeChoice:
    """The chosen dtype, the fewest rows its dense layers should run (padding smaller batches), and the
    measured step times in seconds per candidate (one per entry of ``ROWS``; for a single named dtype, at
    1 and ``PAD_ROWS`` tokens)."""

    dtype: torch.dtype
    min_rows: int
    seconds: dict[str, tuple[float, ...]]


def _timed(run: Callable[[], None]) -> float:
    best = math.inf
    for _ in range(REPEATS):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def _step_seconds(config: ModelConfig, device: torch.device, dtype: torch.dtype, rows: int) -> float:
    """Dense-layer seconds of one step of ``rows`` tokens (logits for at most ``PAD_ROWS`` of them)."""
    hidden, heads = config.hidden_size, config.num_heads
    qkv = (heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = ((qkv, hidden), (hidden, heads * config.head_dim), (2 * config.intermediate_size, hidden))
    weights = [torch.randn(out, inp, dtype=dtype, device=device) for out, inp in shapes]
    down = torch.randn(hidden, config.intermediate_size, dtype=dtype, device=device)
    head = torch.randn(config.vocab_size, hidden, dtype=dtype, device=device)
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    wide = torch.randn(rows, config.intermediate_size, dtype=dtype, device=device)
    logits_rows = x[: min(rows, PAD_ROWS)]

    def layer() -> None:
        for weight in weights:
            F.linear(x, weight)
        F.linear(wide, down)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def logits() -> None:
        F.linear(logits_rows, head)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        return config.num_layers * _timed(layer) + _timed(logits)


def _supported(name: str, device: torch.device) -> bool:
    if device.type == "cuda" and name == "bfloat16":
        return torch.cuda.is_bf16_supported()
    return True


def choose_dtype(config: ModelConfig, device: torch.device, names: tuple[str, ...] = ()) -> DtypeChoice:
    """Time each dtype of ``names`` (default: this device's candidates) and take the fastest; logs the
    figures. With one name, only whether to pad small batches is measured."""
    candidates = names or CANDIDATES.get(device.type, ("float32",))
    rows = ROWS if len(candidates) > 1 else (1, PAD_ROWS)  # one dtype: only the padding is in question
    seconds: dict[str, tuple[float, ...]] = {}
    for name in candidates:
        if _supported(name, device):
            seconds[name] = tuple(_step_seconds(config, device, getattr(torch, name), r) for r in rows)
    best = min(seconds, key=lambda name: math.prod(seconds[name]))
    dtype = getattr(torch, best)
    padded = seconds[best][rows.index(PAD_ROWS)]  # a 16-row step is a padded 1-row step
    min_rows = PAD_ROWS if padded < seconds[best][rows.index(1)] else 1
    log.info(
        "dtype (step of %s tokens): %s; chose %s%s",
        "/".join(map(str, rows)),
        ", ".join(f"{n} {'/'.join(f'{s * 1e3:.1f}' for s in t)} ms" for n, t in seconds.items()),
        best,
        f" (batches under {PAD_ROWS} rows padded: {padded * 1e3:.1f} ms a step)" if min_rows > 1 else "",
    )
    return DtypeChoice(dtype, min_rows, seconds)
