"""Step time of the model with the paged attention kernel against the reference gather + SDPA attention.

    .venv/bin/python bench/attention_kernel.py [--model DIR] [--dtype float32 bfloat16] [--repeats 7]
                                               [--threads N]

Decode steps of 1, 16 and 32 sequences, each with 512 tokens of context, and one prefill chunk of 256
tokens after 512 tokens of context, over a KV cache of random values (block size 16) whose blocks are
shuffled across the pool. ``$WEIR_ATTENTION`` chooses the attention for each run; each figure is the
fastest of ``--repeats`` steps (another load on the machine only adds time). On a machine shared with other
work, ``--threads 1`` gives steadier figures: torch's threads wait for each other at every operator.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.report import format_table, progress, write_json  # noqa: E402
from engine.batch import KVCacheTensors, StepBatch  # noqa: E402
from engine.models import PagedLlama, load_model  # noqa: E402
from engine.models.attention import ATTENTION_ENV  # noqa: E402
from engine.weights import resolve_model_dir, state_dir_from_env  # noqa: E402

CONTEXT = 512
BLOCK_SIZE = 16
# (label, sequences, query tokens per sequence)
STEPS = (("decode", 1, 1), ("decode", 16, 1), ("decode", 32, 1), ("prefill chunk", 1, 256))


def step_batch(num_seqs: int, query_len: int, context: int, pool: list[int]) -> StepBatch:
    """``num_seqs`` sequences each running ``query_len`` tokens at the end of ``context`` tokens."""
    blocks = -(-context // BLOCK_SIZE)
    tables = [pool[i * blocks : (i + 1) * blocks] for i in range(num_seqs)]
    own = range(context - query_len, context)
    positions = [p for _ in tables for p in own]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t in tables for p in own]
    return StepBatch.from_lists(
        input_ids=[100 + i % 1000 for i in range(len(positions))],
        positions=positions,
        slot_mapping=slots,
        query_lens=[query_len] * num_seqs,
        context_lens=[context] * num_seqs,
        block_tables=tables,
        logits_indices=[(i + 1) * query_len - 1 for i in range(num_seqs)],
        device=torch.device("cpu"),
    )


def best_step_seconds(model: PagedLlama, batch: StepBatch, kv: KVCacheTensors, repeats: int) -> float:
    model.forward(batch, kv)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        model.forward(batch, kv)
        best = min(best, time.perf_counter() - started)
    return best


def measure(model: PagedLlama, repeats: int) -> list[tuple]:
    """Rows of (dtype, step, sequences, reference ms, kernel ms, speed-up) for every entry of ``STEPS``."""
    most_blocks = max(n for _, n, _ in STEPS) * -(-CONTEXT // BLOCK_SIZE)
    kv = model.new_kv_cache(most_blocks, BLOCK_SIZE)
    for cache in (*kv.keys, *kv.values):
        cache.normal_()
    pool = torch.randperm(most_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for label, num_seqs, query_len in STEPS:
        batch = step_batch(num_seqs, query_len, CONTEXT, pool)
        seconds = {}
        for backend in ("reference", "kernel"):
            os.environ[ATTENTION_ENV] = backend
            progress(f"{model.dtype} {label} x{num_seqs}: {backend}")
            seconds[backend] = best_step_seconds(model, batch, kv, repeats)
        reference, kernel = seconds["reference"] * 1e3, seconds["kernel"] * 1e3
        rows.append(
            (str(model.dtype).removeprefix("torch."), label, num_seqs, reference, kernel, reference / kernel)
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Llama-family directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's choice)")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model, state_dir_from_env())
    rows = []
    for dtype in args.dtype:
        rows += measure(load_model(model_dir, "cpu", dtype), args.repeats)
    headers = ("dtype", "step", "sequences", "reference ms", "kernel ms", "speed-up")
    threads = torch.get_num_threads()
    print(f"{model_dir.name}, {CONTEXT} tokens of context, {threads} threads, best of {args.repeats} steps")
    print(format_table(headers, rows))
    if args.out:
        write_json(
            args.out,
            {"benchmark": "attention_kernel", "results": [dict(zip(headers, r, strict=True)) for r in rows]},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
