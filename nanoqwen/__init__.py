"""nanoqwen: an annotated LLM inference runtime for Qwen2.5-Coder on NVIDIA Hopper."""

from importlib.metadata import PackageNotFoundError, version

from .config import ModelConfig
from .engine import Engine, GenerationResult, TokenPiece
from .errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    ContextLengthError,
    GenerationError,
    KVCacheFullError,
    NanoqwenError,
    NanoqwenFormatError,
)
from .loader import Int4Linear, LayerWeights, Model, load
from .sampling import SamplingParams

try:
    __version__ = version("nanoqwen")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "ContextLengthError",
    "Engine",
    "GenerationError",
    "GenerationResult",
    "Int4Linear",
    "KVCacheFullError",
    "LayerWeights",
    "Model",
    "ModelConfig",
    "NanoqwenError",
    "NanoqwenFormatError",
    "SamplingParams",
    "TokenPiece",
    "__version__",
    "load",
]
