"""``dtype="auto"``: the compute dtype in which this machine runs the model's own shapes fastest.

The dense layers are most of a step's time, so the choice times them: one layer's projections (QKV, output,
gate/up, down) scaled by the number of layers, plus the logits projection, at a single-sequence decode, a
decode batch and a prefill chunk, with random weights of the model's shapes. The score of a dtype is the
geometric mean of the three step times, so each kind of step counts alike. Some CPUs run bf16 several times
faster than fp32 at these shapes, others slower; fp16 and bf16 are also tried on CUDA.

Each dtype is timed with every matrix-product kernel that runs it here (``dense.KERNELS``); a dtype's score
takes, for each of its products (``PRODUCTS``) at each row count, the fastest kernel, and each product of the
chosen dtype gets a :class:`~engine.models.dense.KernelPlan` that runs each row count with the kernel
measured fastest for it nearest to that count (the logits projection, which runs at most ``PAD_ROWS`` rows
here, is judged only at those counts). Per product, because the kernels' strengths differ by shape: on the
AMX Xeon at 512 rows oneDNN's primitive ran the gate/up projection 1.4x faster than the tiled kernel, which
ran the down projection 1.45x faster.

``$WEIR_DENSE_KERNEL`` (``aten``, ``onednn``, ``brgemm`` or ``dot``) runs every product by that kernel where
the dtype has it, without timing the others: for runs that must compare like with like (``auto``, the
default, measures).

Some CPU bf16 kernels are far slower for a handful of rows than for a few more, so the choice also measures
whether padding small batches to ``PAD_ROWS`` rows is faster, and says so in ``min_rows``. Where the two
are close (AMX runs 16 rows as fast as one), that choice falls either way from one start to the next;
``$WEIR_PAD_SMALL_BATCHES`` (``yes`` or ``no``) makes it without measuring, for runs that compare servers.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.models.config import ModelConfig
from engine.models.dense import KERNELS, ROLES, Dense, KernelPlan, available_kernels

log = logging.getLogger("weir.engine")

ROWS = (1, 16, 256)  # a single decode, a decode batch, a prefill chunk
PAD_ROWS = 16
PRODUCTS = (*ROLES, "lm_head")  # each layer's four products, and the logits projection
PAD_GAIN = 0.9  # pad only when a padded step measures at most this fraction of a 1-row step
REPEATS = 5  # the fastest of this many runs counts
KERNEL_ENV = "WEIR_DENSE_KERNEL"
PAD_ENV = "WEIR_PAD_SMALL_BATCHES"
CANDIDATES = {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16", "float16", "float32")}


@dataclass(frozen=True)
class DtypeChoice:
    """The chosen dtype, its kernel plan for each product (``PRODUCTS``), the fewest rows its dense layers
    should run (padding smaller batches), and the measured times in seconds, one per entry of ``ROWS``: per
    dtype, a step with the fastest kernel for each product at each count (``seconds``); for the chosen
    dtype, per product and kernel, that product's time in such a step (``product_seconds``: all layers'
    for a layer's product; the logits projection's runs at most ``PAD_ROWS`` rows)."""

    dtype: torch.dtype
    min_rows: int
    seconds: dict[str, tuple[float, ...]]
    plans: dict[str, KernelPlan] = field(default_factory=dict)
    product_seconds: dict[str, dict[str, tuple[float, ...]]] = field(default_factory=dict)


def fastest_seconds(run: Callable[[], object], repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` runs of ``run``, in seconds."""
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def _step_seconds(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kernels: tuple[str, ...],
    rows: tuple[int, ...],
) -> dict[str, dict[str, tuple[float, ...]]]:
    """Per product and kernel, its seconds in a step of each of ``rows`` tokens: a layer's product for all
    layers, the logits projection for at most ``PAD_ROWS`` of the tokens. The kernels take turns within
    each repeat, so that a slow moment of the machine falls on all of them rather than on whichever ran
    then."""
    hidden, heads = config.hidden_size, config.num_heads
    qkv = (heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = {
        "qkv": (qkv, hidden),
        "out": (hidden, heads * config.head_dim),
        "gate_up": (2 * config.intermediate_size, hidden),
        "down": (hidden, config.intermediate_size),
        "lm_head": (config.vocab_size, hidden),
    }
    matrices = {name: torch.randn(*shape, dtype=dtype, device=device) for name, shape in shapes.items()}
    forms = {
        kernel: {name: Dense(m, None, KernelPlan(((1, kernel),))) for name, m in matrices.items()}
        for kernel in kernels
    }
    repeat = {name: 1 if name == "lm_head" else config.num_layers for name in PRODUCTS}

    def timed(product: Dense, x: torch.Tensor) -> float:
        started = time.perf_counter()
        product(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    seconds = {name: {kernel: [] for kernel in kernels} for name in PRODUCTS}
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, hidden, dtype=dtype, device=device)
            inputs = {
                "qkv": x,
                "out": x,
                "gate_up": x,
                "down": torch.randn(count, config.intermediate_size, dtype=dtype, device=device),
                "lm_head": x[: min(count, PAD_ROWS)],
            }
            best = {(name, kernel): math.inf for name in PRODUCTS for kernel in kernels}
            for _ in range(REPEATS):
                for kernel, products in forms.items():
                    for name, product in products.items():
                        best[name, kernel] = min(best[name, kernel], timed(product, inputs[name]))
            for (name, kernel), fastest in best.items():
                seconds[name][kernel].append(repeat[name] * fastest)
    return {name: {k: tuple(times) for k, times in by_kernel.items()} for name, by_kernel in seconds.items()}


def kernels_to_time(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels to time for ``dtype``: every one that runs it here, or the one ``$WEIR_DENSE_KERNEL``
    names (``aten`` where that one does not run ``dtype`` here)."""
    available = available_kernels(device, dtype)
    wanted = _env_choice(KERNEL_ENV, tuple(KERNELS))
    if wanted == "auto":
        return available
    return (wanted,) if wanted in available else ("aten",)


def pad_small_batches(padded_s: float, single_s: float) -> bool:
    """Whether to pad batches under ``PAD_ROWS`` rows: as ``$WEIR_PAD_SMALL_BATCHES`` says, else when a
    padded step measured clearly faster than a 1-row one (by ``PAD_GAIN``: where the two take the same
    time, as where reading the weights bounds both, the timing's noise would decide)."""
    wanted = _env_choice(PAD_ENV, ("yes", "no"))
    return padded_s <= PAD_GAIN * single_s if wanted == "auto" else wanted == "yes"


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """``$name``, lower-cased: ``auto`` (also when unset) or one of ``choices``; ValueError otherwise."""
    wanted = os.environ.get(name, "auto").strip().lower()
    if wanted != "auto" and wanted not in choices:
        raise ValueError(f"{name} must be auto or one of {', '.join(choices)}, got {wanted!r}")
    return wanted


def _supported(name: str, device: torch.device) -> bool:
    if device.type == "cuda" and name == "bfloat16":
        return torch.cuda.is_bf16_supported()
    return True


def _ms(times: tuple[float, ...]) -> str:
    return "/".join(f"{t * 1e3:.1f}" for t in times) + " ms"


def choose_dtype(config: ModelConfig, device: torch.device, names: tuple[str, ...] = ()) -> DtypeChoice:
    """Time each dtype of ``names`` (default: this device's candidates) with each kernel that runs it, and
    take the fastest dtype and, per product and row count, kernel; logs the figures."""
    candidates = names or CANDIDATES.get(device.type, ("float32",))
    by_product: dict[str, dict[str, dict[str, tuple[float, ...]]]] = {}
    for name in candidates:
        if _supported(name, device):
            dtype = getattr(torch, name)
            by_product[name] = _step_seconds(config, device, dtype, kernels_to_time(device, dtype), ROWS)
    seconds = {
        name: tuple(
            sum(min(times[i] for times in kernels.values()) for kernels in products.values())
            for i in range(len(ROWS))
        )
        for name, products in by_product.items()
    }
    best = min(seconds, key=lambda name: math.prod(seconds[name]))
    plans = {product: _plan(product, kernels) for product, kernels in by_product[best].items()}
    padded = seconds[best][ROWS.index(PAD_ROWS)]  # a 16-row step is a padded 1-row step
    min_rows = PAD_ROWS if pad_small_batches(padded, seconds[best][ROWS.index(1)]) else 1
    log.info(
        "dtype (step of %s tokens): %s; chose %s, products by %s%s",
        "/".join(map(str, ROWS)),
        ", ".join(
            f"{n}/{k} {_ms(_step_with(products, k))}"
            for n, products in by_product.items()
            for k in next(iter(products.values()))
        ),
        best,
        _describe(plans),
        f" (batches under {PAD_ROWS} rows padded: {padded * 1e3:.1f} ms a step)" if min_rows > 1 else "",
    )
    return DtypeChoice(getattr(torch, best), min_rows, seconds, plans, by_product[best])


def _plan(product: str, kernels: dict[str, tuple[float, ...]]) -> KernelPlan:
    """The product's kernel per row count: the fastest measured at each count where the product runs at
    that count's rows (the logits projection's never exceed ``PAD_ROWS``)."""
    counts = [i for i, count in enumerate(ROWS) if product != "lm_head" or count <= PAD_ROWS]
    fastest = tuple(min(kernels, key=lambda k, i=i: kernels[k][i]) for i in counts)
    return KernelPlan.from_measured(tuple(ROWS[i] for i in counts), fastest)


def _step_with(products: dict[str, dict[str, tuple[float, ...]]], kernel: str) -> tuple[float, ...]:
    """A step's seconds at each count with every product run by ``kernel``."""
    return tuple(sum(kernels[kernel][i] for kernels in products.values()) for i in range(len(ROWS)))


def _describe(plans: dict[str, KernelPlan]) -> str:
    """The plans, once when every product's reads the same."""
    described = {plan.describe() for plan in plans.values()}
    if len(described) == 1:
        return described.pop()
    return "; ".join(f"{product} {plan.describe()}" for product, plan in plans.items())
