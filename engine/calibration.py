"""Start-up calibration of the step-time model: a few steps of known sizes, timed on the real model.

The steps run on scratch KV blocks taken from the pool and returned at once (the engine holds no request
yet); their contents are placeholders, which is all a timing needs.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from engine.batch import KVCacheTensors, StepBatch
from engine.kv_cache import KVCacheManager
from engine.step_time import StepSample

log = logging.getLogger("weir.engine")

PREFILL_SIZES = (16, 64, 256)  # prompt tokens of the prefill steps (capped by the step budget)
DECODE_SIZES = (1, 16)  # sequences of the decode-only steps (capped by max_num_seqs)
DECODE_CONTEXT = 32  # tokens of context each calibration decode attends to
REPEATS = 2  # each shape is timed this often; the fastest run counts (the first warms up)


def _batch(
    kv: KVCacheManager, prefill: int, decodes: int, vocab: int, device: torch.device
) -> tuple[StepBatch, list[str]]:
    """A step with ``decodes`` decodes then one prefill chunk of ``prefill`` tokens, and the scratch tables
    it holds blocks under."""
    ids, positions, slots, query_lens, context_lens, tables = [], [], [], [], [], []
    shapes = [(f"calibrate-d{i}", DECODE_CONTEXT - 1, 1) for i in range(decodes)]
    if prefill:
        shapes.append(("calibrate-p", 0, prefill))
    for name, start, n in shapes:
        kv.grow(name, start + n)  # the caller checked that the free blocks hold the step
        ids.extend((start + i) % vocab for i in range(n))
        positions.extend(range(start, start + n))
        slots.extend(kv.slots(name, start, start + n))
        query_lens.append(n)
        context_lens.append(start + n)
        tables.append(kv.block_tables[name])
    rows = list(range(decodes)) + ([len(ids) - 1] if prefill else [])
    batch = StepBatch.from_lists(
        input_ids=ids,
        positions=positions,
        slot_mapping=slots,
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=tables,
        logits_indices=rows,
        device=device,
    )
    return batch, [name for name, _, _ in shapes]


def _fits(kv: KVCacheManager, prefill: int, decodes: int) -> bool:
    size = kv.block_size
    return -(-prefill // size) + decodes * -(-DECODE_CONTEXT // size) <= kv.num_free_blocks


def calibration_shapes(
    max_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> list[tuple[int, int]]:
    """The ``(prefill tokens, decodes)`` of the steps to time, within the engine's limits."""
    prefill_cap = min(max_batched_tokens, max_model_len)
    prefills = sorted({min(p, prefill_cap) for p in PREFILL_SIZES})
    decodes = sorted({min(d, max_num_seqs) for d in DECODE_SIZES}) if max_model_len >= DECODE_CONTEXT else []
    return [(p, 0) for p in prefills] + [(0, d) for d in decodes]


def calibrate(
    model,  # engine.models.PagedLlama
    kv: KVCacheManager,
    kv_tensors: KVCacheTensors,
    shapes: list[tuple[int, int]],
    device: torch.device,
) -> list[StepSample]:
    """Time each ``(prefill tokens, decodes)`` step shape; shapes the free blocks cannot hold are skipped."""
    samples = []
    vocab = model.config.vocab_size
    for prefill, decodes in shapes:
        if not _fits(kv, prefill, decodes):
            continue
        best = math.inf
        for _ in range(REPEATS):
            batch, tables = _batch(kv, prefill, decodes, vocab, device)
            try:
                started = time.perf_counter()
                model.forward(batch, kv_tensors)
                best = min(best, time.perf_counter() - started)
            finally:
                for name in tables:
                    kv.free(name)
        samples.append(StepSample(prefill, decodes, best))
    log.info(
        "step-time calibration: %s",
        ", ".join(
            f"{s.prefill_tokens} prefill + {s.decodes} decodes {s.seconds * 1e3:.1f} ms" for s in samples
        ),
    )
    return samples
