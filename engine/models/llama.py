"""The Llama family (Llama, SmolLM2, Qwen2-style biases) running one flattened step over a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.batch import KVCacheTensors, StepBatch
from engine.models import layer_ops
from engine.models.attention import AttentionPlan, GatherBuffers, paged_attention
from engine.models.config import ModelConfig
from engine.models.dense import Dense, KernelPlan
from engine.models.dtype_choice import choose_dtype
from engine.models.loader import LayerWeights, ModelWeights, load_weights
from engine.models.memory import retain_freed_memory
from engine.models.packed_weights import ROLES, PackedWeights, pack_weights
from engine.models.rope import Rotary, apply_rotary


@dataclass
class Layer:
    """One decoder layer as it runs: its norms, and its projections in the forms their kernels use."""

    input_norm: torch.Tensor
    qkv: Dense
    out: Dense
    post_norm: torch.Tensor
    gate_up: Dense
    down: Dense

    @classmethod
    def of(cls, weights: LayerWeights, plans: dict[str, KernelPlan]) -> Layer:
        def dense(role: str) -> Dense:
            return Dense(
                getattr(weights, role), getattr(weights, f"{role}_bias"), plans.get(role, KernelPlan())
            )

        return cls(
            input_norm=weights.input_norm,
            qkv=dense("qkv"),
            out=dense("out"),
            post_norm=weights.post_norm,
            gate_up=dense("gate_up"),
            down=dense("down"),
        )


class PagedLlama:
    """A decoder-only Llama whose dense layers see all of a step's tokens as one [T, hidden] batch."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        device: torch.device,
        dtype: torch.dtype,
        min_rows: int = 1,
        plans: dict[str, KernelPlan] | None = None,
    ) -> None:
        self.config = config
        self.plans = plans or {}  # each product's kernel plan (``dtype_choice.PRODUCTS``); aten's by default
        self.embed, self.final_norm = weights.embed, weights.final_norm
        self.layers = [Layer.of(layer, self.plans) for layer in weights.layers]
        self.lm_head = Dense(weights.lm_head, None, self.plans.get("lm_head", KernelPlan()))
        self.device = device
        self.dtype = dtype
        self.min_rows = min_rows  # dense layers run at least this many rows (see dtype_choice)
        self.rotary = Rotary(config, device, dtype)
        self.gather_buffers = GatherBuffers()
        self.packed: PackedWeights | None = None
        self.fused = layer_ops.fused_available(dtype, device)  # bf16 norms and RoPE as single C++ calls
        self.fused_silu = self.fused and layer_ops.silu_mul_available()

    def use_packed(self, packed: PackedWeights) -> None:
        """Let the dense layers run ``packed``'s matrices for the row counts each is chosen for."""
        for layer, packed_layer in zip(self.layers, packed.layers, strict=True):
            for role in ROLES:
                getattr(layer, role).packed = getattr(packed_layer, role)
        self.lm_head.packed = packed.lm_head
        self.packed = packed

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of K and V, all layers together, for one block of ``block_size`` tokens."""
        cfg = self.config
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCacheTensors:
        """A zeroed paged cache of ``num_blocks`` blocks of ``block_size`` tokens for every layer."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token, got {num_blocks} x {block_size}"
            )
        cfg = self.config
        shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)

        def zeros() -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        return KVCacheTensors(
            keys=[zeros() for _ in range(cfg.num_layers)],
            values=[zeros() for _ in range(cfg.num_layers)],
            block_size=block_size,
        )

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KVCacheTensors) -> torch.Tensor:
        """Run one step: write its K/V into ``kv`` and return float32 logits [len(logits_indices), vocab]."""
        cfg = self.config
        plan = AttentionPlan.build(batch, kv.block_size, cfg.head_dim, self.device, self.dtype)
        input_ids = batch.input_ids.to(self.device)
        if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size}) for this model")
        slots = batch.slot_mapping.to(self.device)
        cos, sin = self.rotary.lookup(batch.positions.to(self.device))
        hidden = F.embedding(input_ids, self.embed)
        delta = None  # each layer's MLP output, added into the stream where the next norm reads it
        for index, layer in enumerate(self.layers):
            hidden, delta = self._layer(
                hidden, delta, layer, kv.keys[index], kv.values[index], kv.block_size, slots, cos, sin, plan
            )
        rows = batch.logits_indices.to(self.device)
        last = None if delta is None else delta.index_select(0, rows)
        normed = self._add_norm(hidden.index_select(0, rows), last, self.final_norm)
        return self._linear(normed, self.lm_head).float()

    __call__ = forward

    def _layer(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        layer: Layer,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_size: int,
        slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream ``hidden`` once the previous layer's ``delta`` is added in: the
        stream (its attention output added) and this layer's MLP output, for the next norm to add."""
        cfg = self.config
        tokens = hidden.shape[0]
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self._add_norm(hidden, delta, layer.input_norm)
        qkv = self._linear(x, layer.qkv)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        if self.fused:
            q, k = layer_ops.rope_and_cache(qkv, cos, sin, key_cache, value_cache, slots, heads, kv_heads)
        else:
            rotated = apply_rotary(
                qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim), cos, sin
            )
            q, k = rotated[:, :heads], rotated[:, heads:]
            key_cache.index_copy_(0, slots, k)
            value_cache.index_copy_(0, slots, v)
        attn = paged_attention(q, k, v, key_cache, value_cache, block_size, plan, self.gather_buffers)
        x = self._add_norm(hidden, self._linear(attn, layer.out), layer.post_norm)
        return hidden, self._linear(self._silu_mul(self._linear(x, layer.gate_up)), layer.down)

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, norm: torch.Tensor) -> torch.Tensor:
        """Add ``delta`` (if any) into ``hidden`` in place; return ``hidden`` RMS-normalized by ``norm``."""
        eps = self.config.rms_norm_eps
        if self.fused:
            if delta is None:
                return layer_ops.rms_norm(hidden, norm, eps)
            return layer_ops.add_rms_norm(hidden, delta, norm, eps)
        if delta is not None:
            hidden.add_(delta)
        return rms_norm(hidden, norm, eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_silu:
            return layer_ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)

    def _linear(self, x: torch.Tensor, dense: Dense) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 0 or dense.runs_packed(rows):
            return dense(x)
        target = dense.rows_to_run(max(self.min_rows, rows))
        if rows == target:
            return dense(x)
        padded = F.pad(x.reshape(rows, -1), (0, 0, 0, target - rows))
        return dense(padded)[:rows].reshape(*x.shape[:-1], -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm rounded as Hugging Face's Llama rounds it: normalized in fp32, cast back, then scaled (in a
    16-bit dtype the order of roundings decides near-tied greedy tokens)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def load_model(
    model_dir: Path | str, device: str | torch.device = "cpu", dtype: str = "float32"
) -> PagedLlama:
    """Load a Hugging Face Llama-family directory (config.json + safetensors); ValueError if unsupported.

    ``dtype`` is a torch dtype's name or ``"auto"`` (the fastest here, measured: see ``dtype_choice``).
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    retain_freed_memory()
    device = torch.device(device)
    choice = choose_dtype(config, device, () if dtype == "auto" else (dtype,))
    weights = load_weights(model_dir, config, device, choice.dtype)
    model = PagedLlama(config, weights, device, choice.dtype, choice.min_rows, choice.plans)
    dense = {role: [getattr(layer, role) for layer in model.layers] for role in ROLES}
    dense["lm_head"] = [model.lm_head]
    fp32_weights = (
        (lambda: weights)
        if choice.dtype == torch.float32
        else (lambda: load_weights(model_dir, config, device, torch.float32))
    )
    packed = pack_weights(fp32_weights, device, choice.dtype, dense)
    if packed is not None:
        model.use_packed(packed)
    return model
