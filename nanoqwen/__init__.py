"""nanoqwen: an annotated LLM inference runtime for Qwen2.5-Coder on NVIDIA Hopper."""

from .config import ConfigError, ModelConfig
from .loader import Int4Linear, LayerWeights, Model, NanoqwenFormatError, load

__all__ = ["ConfigError", "Int4Linear", "LayerWeights", "Model", "ModelConfig", "NanoqwenFormatError", "load"]

from .engine import BackendUnavailableError, ContextLengthError, Engine, GenerationError, GenerationResult, TokenPiece
from .kvcache import KVCacheFullError
from .sampling import SamplingParams

__all__ += [
    "BackendUnavailableError",
    "ContextLengthError",
    "Engine",
    "GenerationError",
    "GenerationResult",
    "KVCacheFullError",
    "SamplingParams",
    "TokenPiece",
]
