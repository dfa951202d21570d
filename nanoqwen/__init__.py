"""nanoqwen: an annotated LLM inference runtime for Qwen2.5-Coder on NVIDIA Hopper."""

from .config import ConfigError, ModelConfig
from .loader import Int4Linear, LayerWeights, Model, NanoqwenFormatError, load

__all__ = ["ConfigError", "Int4Linear", "LayerWeights", "Model", "ModelConfig", "NanoqwenFormatError", "load"]
