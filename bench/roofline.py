"""The roofline of a workload: per engine step, the larger of its FLOPs at the measured matmul rate and the
bytes it must move (the weights once, the KV it reads and writes) at the measured memory bandwidth.

The steps are those of an ideal continuous-batching schedule with the engine's limits: every request there
from the start, every running sequence decoding each step, prefill chunks filling the rest of the token
budget in arrival order. Nothing is counted twice (no recomputation, no padding), so no schedule with these
limits can take less time on this machine; activations and sampling are left out, which lowers it further.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bench.ceiling import ModelShape


@dataclass(frozen=True)
class Machine:
    """What the roofline is drawn with: a dense matmul rate and a memory read bandwidth, both measured."""

    flops_per_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class StepWork:
    flops: int
    bytes: int

    def seconds(self, machine: Machine) -> float:
        return max(self.flops / machine.flops_per_s, self.bytes / machine.bytes_per_s)


def weight_bytes(shape: ModelShape, bytes_per_value: int) -> int:
    """The weights a step reads: every layer's projections and MLP, and the logits projection."""
    per_layer = shape.dense_flops_per_token() // (2 * shape.layers)  # one multiply-add per weight
    return bytes_per_value * (shape.layers * per_layer + shape.hidden * shape.vocab)


def kv_bytes_per_token(shape: ModelShape, bytes_per_value: int) -> int:
    return bytes_per_value * 2 * shape.layers * shape.kv_heads * shape.head_dim


def ideal_steps(
    shape: ModelShape,
    lengths: list[tuple[int, int]],
    *,
    max_num_seqs: int,
    max_batched_tokens: int,
    prefill_chunk_size: int,
    bytes_per_value: int,
) -> list[StepWork]:
    """The work of each step of the ideal schedule for (prompt_len, output_len) requests."""
    weights = weight_bytes(shape, bytes_per_value)
    kv = kv_bytes_per_token(shape, bytes_per_value)
    fed = [0] * len(lengths)  # tokens whose K/V exist
    to_feed = [p + o - 1 for p, o in lengths]  # the last output token is never fed back
    waiting = list(range(len(lengths)))
    running: list[int] = []
    steps = []
    while waiting or running:
        flops = bytes_moved = 0
        budget = max_batched_tokens
        for i in list(running):
            prompt = lengths[i][0]
            if fed[i] < prompt or budget == 0:
                continue
            flops, bytes_moved, budget = _feed(shape, i, fed, 1, flops, bytes_moved, budget, kv)
            flops += shape.logits_flops()
        for i in [*running, *waiting]:
            if budget == 0:
                break
            prompt = lengths[i][0]
            if fed[i] >= prompt:
                continue
            if i in waiting:
                if len(running) >= max_num_seqs:
                    continue
                waiting.remove(i)
                running.append(i)
            n = min(prompt - fed[i], prefill_chunk_size, budget)
            flops, bytes_moved, budget = _feed(shape, i, fed, n, flops, bytes_moved, budget, kv)
            if fed[i] == prompt:
                flops += shape.logits_flops()
        running = [i for i in running if fed[i] < to_feed[i]]  # done: every output token sampled
        steps.append(StepWork(flops, bytes_moved + weights))
    return steps


def _feed(
    shape: ModelShape, i: int, fed: list[int], n: int, flops: int, bytes_moved: int, budget: int, kv: int
) -> tuple[int, int, int]:
    """Feed ``n`` tokens of request ``i``: dense layers, attention over the context, KV read and written."""
    start = fed[i]
    attended = sum(range(start + 1, start + n + 1))
    flops += n * shape.dense_flops_per_token() + shape.attention_flops(attended)
    bytes_moved += kv * (start + n)  # the context read once per chunk, the new K/V written
    fed[i] = start + n
    return flops, bytes_moved, budget - n


def roofline_seconds(steps: list[StepWork], machine: Machine) -> float:
    return sum(step.seconds(machine) for step in steps)


def measure_read_bandwidth(device: str = "cpu", mib: int = 512, repeats: int = 5) -> float:
    """Best rate, in bytes/s, of reading a ``mib`` MiB fp32 tensor once (a sum over it)."""
    import torch

    data = torch.ones(mib * 2**18, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if data.is_cuda else (lambda: None)
    data.sum()  # warm up
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        sync()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best
