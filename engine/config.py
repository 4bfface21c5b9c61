"""How an engine is set up: model, device, memory budget and scheduling limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to start an engine; every field has a working default."""

    model: str | None = None  # a Hugging Face Llama-family directory; None: the default SmolLM2
    device: str = "auto"  # "auto" picks cuda when available
    dtype: str = (
        "auto"  # "auto": the fastest on this device, measured at start (engine/models/dtype_choice.py)
    )
    kv_cache_memory: int = 1 << 30  # bytes of KV memory; the block count follows from the model's shape
    num_kv_blocks: int | None = None  # overrides kv_cache_memory with an exact block count
    block_size: int = 16
    max_batched_tokens: int = 512  # tokens per step
    max_num_seqs: int = 64  # running sequences
    prefill_chunk_size: int = 256  # at most this many prompt tokens of one sequence per step
    max_model_len: int | None = None  # default: the model's context, capped by the KV pool
    policy: str = "fair"  # weighted fair share by cost ("fcfs": first come, first served)
    prefix_caching: bool = True  # share full blocks of identical prompt prefixes (within a tenant)
    state_dir: Path | str | None = None  # default: $WEIR_STATE_DIR, else ./.weir

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        positive = {
            "kv_cache_memory": self.kv_cache_memory,
            "block_size": self.block_size,
            "max_batched_tokens": self.max_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "prefill_chunk_size": self.prefill_chunk_size,
        }
        if self.num_kv_blocks is not None:
            positive["num_kv_blocks"] = self.num_kv_blocks
        if self.max_model_len is not None:
            positive["max_model_len"] = self.max_model_len
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_num_seqs > self.max_batched_tokens:
            raise ValueError("max_num_seqs must not exceed max_batched_tokens: each running sequence decodes")

    def resolved_state_dir(self) -> Path:
        from engine.weights import state_dir_from_env

        return Path(self.state_dir) if self.state_dir is not None else state_dir_from_env()

    def torch_device(self):  # -> torch.device (torch is imported lazily)
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        return torch.device(self.device)
