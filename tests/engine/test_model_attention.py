"""Paged attention: both backends against plain per-sequence attention, and the C++ kernel against the
reference gather + SDPA path on random caches whose blocks are shuffled across the pool."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import pytest
import torch

from engine.batch import StepBatch
from engine.models import paged_kernel
from engine.models.attention import (
    AttentionPlan,
    GatherBuffers,
    attention_backend,
    paged_attention,
)
from engine.models.extension import cpu_flags

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 4
CPU = torch.device("cpu")
# (query length, context length) per sequence, decodes first: decodes of very different lengths (several
# padded groups in the reference), a fresh prefill, a later chunk, and chunks longer than the kernel's tile
MIXED = [(1, n) for n in (1, 2, 5, 9, 33, 34, 120, 200, 7)] + [(13, 13), (6, 27), (37, 37), (40, 95)]


@dataclass
class RandomStep:
    """A step over random caches: its batch, queries and each sequence's cache slots in position order."""

    batch: StepBatch
    q: torch.Tensor  # [T, heads, head_dim], strided as the model's (sliced from q and k together)
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_size: int
    slots: list[list[int]]

    def plan(self, backend: str | None = None) -> AttentionPlan:
        head_dim, dtype = self.q.shape[-1], self.q.dtype
        return AttentionPlan.build(self.batch, self.block_size, head_dim, CPU, dtype, backend=backend)

    def run(self, backend: str) -> torch.Tensor:
        """The attention output of ``backend``, given the step's own K/V as the model gives them."""
        own = self.batch.slot_mapping
        k, v = self.key_cache[own], self.value_cache[own]
        plan = self.plan(backend)
        return paged_attention(
            self.q, k, v, self.key_cache, self.value_cache, self.block_size, plan, GatherBuffers()
        )


def random_step(
    seqs: list[tuple[int, int]],
    *,
    block_size: int = BLOCK,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> RandomStep:
    """Random K/V for ``seqs`` (query length, context length), each sequence holding one spare block, every
    block taken from a shuffled pool so that no table is contiguous or in order."""
    gen = torch.Generator().manual_seed(seed)
    tables_len = [-(-ctx // block_size) + 1 for _, ctx in seqs]
    num_blocks = sum(tables_len)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks * block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = [[free.pop() for _ in range(n)] for n in tables_len]
    slots = [
        [t[p // block_size] * block_size + p % block_size for p in range(ctx)]
        for t, (_, ctx) in zip(tables, seqs, strict=True)
    ]
    step_slots = torch.tensor(
        [s for (q_len, ctx), ss in zip(seqs, slots, strict=True) for s in ss[ctx - q_len :]]
    )
    total = len(step_slots)
    batch = StepBatch(
        input_ids=torch.zeros(total, dtype=torch.int64),
        positions=torch.zeros(total, dtype=torch.int64),
        slot_mapping=step_slots,
        query_lens=[q for q, _ in seqs],
        context_lens=[c for _, c in seqs],
        block_tables=tables,
        logits_indices=torch.zeros(0, dtype=torch.int64),
        num_decodes=sum(1 for q, _ in seqs if q == 1),
    )
    q_and_k = torch.randn(total, heads + kv_heads, head_dim, generator=gen).to(dtype)
    return RandomStep(batch, q_and_k[:, :heads], key_cache, value_cache, block_size, slots)


def plain_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offset: int) -> torch.Tensor:
    """Causal attention of queries at positions offset.. over keys 0..; heads expanded the plain way."""
    group = HEADS // KV_HEADS
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, dim]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(HEAD_DIM)  # [heads, q, ctx]
    allowed = torch.arange(keys.shape[0])[None, :] <= torch.arange(offset, offset + q.shape[0])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(q.shape[0], HEADS * HEAD_DIM)


@pytest.mark.parametrize("backend", ["reference", "kernel"])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_step_matches_plain_attention(backend: str, seed: int) -> None:
    step = random_step(MIXED, seed=seed)
    if backend == "reference":
        assert len(step.plan("reference").decodes) > 1
    out = step.run(backend)
    start = 0
    for (q_len, ctx), seq_slots in zip(MIXED, step.slots, strict=True):
        idx = torch.tensor(seq_slots)
        expected = plain_attention(
            step.q[start : start + q_len], step.key_cache[idx], step.value_cache[idx], ctx - q_len
        )
        torch.testing.assert_close(out[start : start + q_len], expected, rtol=1e-5, atol=1e-5)
        start += q_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "head_dim"),
    [(1, 4, 4, 32), (4, 6, 2, 64), (16, 9, 3, 64), (5, 8, 1, 128), (32, 4, 2, 16)],
)
def test_kernel_matches_the_reference_path(
    dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    step = random_step(
        MIXED, block_size=block_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, seed=3
    )
    kernel, reference = step.run("kernel"), step.run("reference")
    assert kernel.dtype == dtype and kernel.shape == reference.shape
    if dtype == torch.float32:
        torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-5)
    else:  # the same roundings but not the same order of sums: at most a bf16 step apart
        torch.testing.assert_close(kernel.float(), reference.float(), rtol=1.6e-2, atol=1e-2)


# chunks past the kernel's 512-key softmax step and its 64-query matrix tile, with decodes beside them
LONG = [(1, 700), (1, 1030), (70, 1100), (130, 130), (9, 600)]


@pytest.mark.parametrize("onednn", [True, False])
def test_bf16_matrix_and_vector_paths_match_the_reference(onednn: bool) -> None:
    """bf16 steps take the matrix path where the CPU has bf16 matrix or dot instructions and oneDNN is on,
    else the vector path; either gives the reference's result on long, multi-chunk contexts."""
    step = random_step(LONG, block_size=16, heads=9, kv_heads=3, head_dim=64, dtype=torch.bfloat16, seed=7)
    reference = step.run("reference")
    with torch.backends.mkldnn.flags(enabled=onednn):
        kernel = step.run("kernel")
        matrix = paged_kernel.matrix_path()
    bf16_units = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    assert matrix == (onednn and bf16_units)
    torch.testing.assert_close(kernel.float(), reference.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["float32", "bfloat16"]
)
@pytest.mark.parametrize("decodes", [1, 4 * torch.get_num_threads() + 1])
def test_decodes_of_one_or_every_kv_head_match_the_reference(
    decodes: int, dtype: torch.dtype, tolerance: float
) -> None:
    """With decodes enough for every thread, a decode's item reads whole cache rows (every KV head); a few
    decodes take an item per KV head; both give the reference's result, over one or several 512-key chunks."""
    seqs = [(1, 17 + 97 * i) for i in range(decodes)] + [(1, 600), (5, 40)]
    step = random_step(seqs, block_size=16, heads=9, kv_heads=3, head_dim=64, dtype=dtype, seed=11)
    reference = step.run("reference").float()
    torch.testing.assert_close(step.run("kernel").float(), reference, rtol=1.6 * tolerance, atol=tolerance)


@pytest.mark.parametrize("seqs", [[(1, 1)], [(1, 64)] * 5, [(16, 16)], [(17, 80)], [(1, 9), (3, 3)]])
def test_kernel_on_steps_of_one_kind(seqs: list[tuple[int, int]]) -> None:
    step = random_step(seqs, block_size=8, seed=5)
    torch.testing.assert_close(step.run("kernel"), step.run("reference"), rtol=1e-5, atol=1e-5)


def test_kernel_refuses_a_block_outside_the_pool() -> None:
    step = random_step([(1, 9)], seed=2)
    step.batch.block_tables[0][1] = step.key_cache.shape[0] // step.block_size
    with pytest.raises(RuntimeError, match="out of range"):
        step.run("kernel")


def test_the_kernel_is_the_default_on_cpu_and_the_env_selects_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("WEIR_ATTENTION", raising=False)
    assert attention_backend(CPU, torch.float32, 64) == "kernel"
    assert attention_backend(CPU, torch.bfloat16, 128) == "kernel"
    assert attention_backend(CPU, torch.float16, 64) == "reference"
    assert attention_backend(CPU, torch.float32, 80) == "reference"
    step = random_step([(1, 9), (4, 4)])
    plan = step.plan()
    assert plan.kernel is not None and not plan.decodes
    monkeypatch.setenv("WEIR_ATTENTION", "reference")
    plan = step.plan()
    assert plan.kernel is None and plan.decodes
    monkeypatch.setenv("WEIR_ATTENTION", "fast")
    with pytest.raises(ValueError, match="WEIR_ATTENTION"):
        attention_backend(CPU, torch.float32, 64)


def test_a_failed_build_is_a_warning_and_the_reference_path(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(paged_kernel, "SOURCE", broken)
    monkeypatch.setattr(paged_kernel, "NAME", "weir_broken_kernel")
    monkeypatch.setenv("WEIR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("WEIR_KERNEL_DIR", raising=False)
    with caplog.at_level(logging.WARNING, logger="weir.engine"):
        assert paged_kernel.kernel_available() is False
    assert "falls back to the reference" in caplog.text


def test_inconsistent_batch_is_refused() -> None:
    batch = StepBatch(
        input_ids=torch.zeros(2, dtype=torch.int64),
        positions=torch.arange(2),
        slot_mapping=torch.arange(2),
        query_lens=[2],
        context_lens=[9],
        block_tables=[[0]],
        logits_indices=torch.tensor([1]),
        num_decodes=0,
    )
    with pytest.raises(ValueError, match="disagree"):
        AttentionPlan.build(batch, BLOCK, HEAD_DIM, torch.device("cpu"), torch.float32)
