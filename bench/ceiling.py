"""A workload's FLOPs and the machine's measured dense-matmul rate (the compute side of the roofline)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-family decoder that decide its FLOPs."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ModelShape:
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))

    def dense_flops_per_token(self) -> int:
        """Q, K, V, O projections and the gated MLP of every layer (2 FLOPs per multiply-add)."""
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return 2 * self.layers * (q_and_o + k_and_v + mlp)

    def attention_flops(self, context_len: int) -> int:
        """Scores (q.k) and the weighted sum of values for one query over ``context_len`` keys, all layers."""
        return 2 * 2 * self.layers * self.heads * self.head_dim * context_len

    def logits_flops(self) -> int:
        return 2 * self.hidden * self.vocab


def request_flops(shape: ModelShape, prompt_len: int, output_len: int) -> int:
    """FLOPs to serve one request without waste.

    Every prompt token and every output token but the last goes through all layers (the last sampled token
    is never fed back); the token at position ``i`` attends to ``i + 1`` keys; logits are computed once per
    output token (at the last prompt position and at each fed-back output token).
    """
    fed = prompt_len + output_len - 1
    attended = fed * (fed + 1) // 2  # sum over positions of keys attended
    return (
        fed * shape.dense_flops_per_token()
        + shape.attention_flops(attended)
        + output_len * shape.logits_flops()
    )


def workload_flops(shape: ModelShape, lengths: Iterable[tuple[int, int]]) -> int:
    """Total FLOPs of (prompt_len, output_len) pairs."""
    return sum(request_flops(shape, p, o) for p, o in lengths)


def measure_matmul_flops(
    device: str = "cpu", size: int = 2048, repeats: int = 5, dtype: str = "float32"
) -> float:
    """Best rate, in FLOP/s, of a ``size``-cubed matmul in ``dtype`` on ``device`` (on CPU: torch's thread
    count)."""
    import torch

    a = torch.randn(size, size, dtype=getattr(torch, dtype), device=device)
    b = torch.randn(size, size, dtype=getattr(torch, dtype), device=device)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    torch.mm(a, b)  # warm up
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best
