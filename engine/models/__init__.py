"""Model code for the paged engine: the Llama family, loaded from a Hugging Face directory."""

from engine.models.config import ModelConfig
from engine.models.llama import PagedLlama, load_model

__all__ = ["ModelConfig", "PagedLlama", "load_model"]
