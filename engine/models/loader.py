"""Reading a Hugging Face Llama-family checkpoint (safetensors) into fused per-layer weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.config import ModelConfig


@dataclass
class LayerWeights:
    """One decoder layer, with q/k/v fused into one projection and gate/up into another."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    out: torch.Tensor  # [hidden, heads * head_dim]
    out_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, intermediate]
    down_bias: torch.Tensor | None


@dataclass
class ModelWeights:
    """All weights of a paged Llama."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


class _Checkpoint:
    """Tensors by name across the directory's safetensors files, converted on read."""

    def __init__(self, model_dir: Path, device: torch.device | str, dtype: torch.dtype) -> None:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir} has no *.safetensors weights")
        self._where: dict[str, Path] = {}
        for file in files:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    self._where[name] = file
        self._device, self._dtype = device, dtype

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        with safe_open(self._where[name], framework="pt") as handle:
            return handle.get_tensor(name).to(device=self._device, dtype=self._dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self else None

    def fused(self, names: list[str]) -> torch.Tensor | None:
        """The named tensors concatenated along dim 0; None when none exist (e.g. absent biases)."""
        present = [name in self for name in names]
        if not any(present):
            return None
        if not all(present):
            missing = [name for name, there in zip(names, present, strict=True) if not there]
            raise ValueError(f"checkpoint has only some of {names}: missing {missing}")
        return torch.cat([self.get(name) for name in names])


def load_weights(
    model_dir: Path, config: ModelConfig, device: torch.device | str, dtype: torch.dtype
) -> ModelWeights:
    """Read and fuse the weights of ``model_dir``; raise ValueError naming any missing or misshapen tensor."""
    ckpt = _Checkpoint(model_dir, device, dtype)
    layers = []
    for index in range(config.num_layers):
        prefix = f"model.layers.{index}."
        attn = [f"{prefix}self_attn.{p}_proj" for p in ("q", "k", "v")]
        mlp = [f"{prefix}mlp.{p}_proj" for p in ("gate", "up")]
        layers.append(
            LayerWeights(
                input_norm=ckpt.get(f"{prefix}input_layernorm.weight"),
                qkv=ckpt.fused([f"{name}.weight" for name in attn]),
                qkv_bias=ckpt.fused([f"{name}.bias" for name in attn]),
                out=ckpt.get(f"{prefix}self_attn.o_proj.weight"),
                out_bias=ckpt.optional(f"{prefix}self_attn.o_proj.bias"),
                post_norm=ckpt.get(f"{prefix}post_attention_layernorm.weight"),
                gate_up=ckpt.fused([f"{name}.weight" for name in mlp]),
                gate_up_bias=ckpt.fused([f"{name}.bias" for name in mlp]),
                down=ckpt.get(f"{prefix}mlp.down_proj.weight"),
                down_bias=ckpt.optional(f"{prefix}mlp.down_proj.bias"),
            )
        )
        _check_layer(layers[-1], config, index)
    embed = ckpt.get("model.embed_tokens.weight")
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"embedding shape {tuple(embed.shape)} does not match the config")
    tied = config.tie_word_embeddings or "lm_head.weight" not in ckpt
    lm_head = embed if tied else ckpt.get("lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=ckpt.get("model.norm.weight"), lm_head=lm_head)


def _check_layer(layer: LayerWeights, config: ModelConfig, index: int) -> None:
    hidden, head_dim = config.hidden_size, config.head_dim
    expected = {
        "qkv": (layer.qkv, ((config.num_heads + 2 * config.num_kv_heads) * head_dim, hidden)),
        "o_proj": (layer.out, (hidden, config.num_heads * head_dim)),
        "gate_up": (layer.gate_up, (2 * config.intermediate_size, hidden)),
        "down_proj": (layer.down, (hidden, config.intermediate_size)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"layer {index} {name} has shape {tuple(tensor.shape)}, config implies {shape}")
