"""Start-up calibration of the step-time model: a few steps of known sizes, timed on the real model.

The steps run on scratch KV blocks taken from the pool and returned at once (the engine holds no request
yet); their contents are placeholders, which is all a timing needs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.sequence import Sequence
from engine.step_time import StepSample
from engine.types import SamplingParams

log = logging.getLogger("weir.engine")

PREFILL_SIZES = (16, 64, 256)  # prompt tokens of the prefill steps (capped by the step budget)
DECODE_SIZES = (1, 16)  # sequences of the decode-only steps (capped by max_num_seqs)
DECODE_CONTEXT = 32  # tokens of context each calibration decode attends to
REPEATS = 2  # each shape is timed this often; the fastest run counts (the first warms up)


def _scratch(
    kv: KVCacheManager, prefill: int, decodes: int, vocab: int, context: int
) -> list[tuple[Sequence, int]]:
    """A step of ``decodes`` decodes, each at the end of ``context`` tokens, then one prefill chunk of
    ``prefill`` tokens, on scratch sequences that hold blocks (the caller checked that the free blocks hold
    the step)."""
    shapes = [(f"calibrate-d{i}", context - 1, 1) for i in range(decodes)]
    if prefill:
        shapes.append(("calibrate-p", 0, prefill))
    scheduled = []
    for name, start, n in shapes:
        seq = Sequence(
            name, [i % vocab for i in range(start + n)], SamplingParams(), num_computed_tokens=start
        )
        kv.grow(name, start + n)
        scheduled.append((seq, n))
    return scheduled


def _fits(kv: KVCacheManager, prefill: int, decodes: int, context: int) -> bool:
    size = kv.block_size
    return -(-prefill // size) + decodes * -(-context // size) <= kv.num_free_blocks


def calibration_shapes(
    max_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> list[tuple[int, int]]:
    """The ``(prefill tokens, decodes)`` of the steps to time, within the engine's limits."""
    prefill_cap = min(max_batched_tokens, max_model_len)
    prefills = sorted({min(p, prefill_cap) for p in PREFILL_SIZES})
    decodes = sorted({min(d, max_num_seqs) for d in DECODE_SIZES}) if max_model_len >= DECODE_CONTEXT else []
    return [(p, 0) for p in prefills] + [(0, d) for d in decodes]


def calibrate(
    runner: ModelRunner,
    shapes: list[tuple[int, int]],
    context: int = DECODE_CONTEXT,
    repeats: int = REPEATS,
    statistic: Callable[[list[float]], float] = min,
) -> list[StepSample]:
    """Time each ``(prefill tokens, decodes)`` step shape, its decodes attending to ``context`` tokens each:
    ``statistic`` of ``repeats`` runs (by default the fastest); shapes the free blocks cannot hold are
    skipped."""
    samples = []
    kv, vocab = runner.kv, runner.model.config.vocab_size
    for prefill, decodes in shapes:
        if not _fits(kv, prefill, decodes, context):
            continue
        runs = []
        for _ in range(repeats):
            scheduled = _scratch(kv, prefill, decodes, vocab, context)
            try:
                started = time.perf_counter()
                runner.run(scheduled)
                runs.append(time.perf_counter() - started)
            finally:
                for seq, _ in scheduled:
                    kv.free(seq.request_id)
        samples.append(StepSample(prefill, decodes, statistic(runs)))
    log.info(
        "step-time calibration: %s",
        ", ".join(
            f"{s.prefill_tokens} prefill + {s.decodes} decodes {s.seconds * 1e3:.1f} ms" for s in samples
        ),
    )
    return samples
