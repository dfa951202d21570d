"""Every error nanoqwen raises on purpose, in one module that imports nothing else of nanoqwen.

Each names what is wrong in its message. All of them derive from `NanoqwenError`, so a caller
(the CLI among them) can tell nanoqwen's verdict on its input from a bug, and each also derives
from the built-in class a Python caller would expect (ValueError for bad input, RuntimeError for a
state of the machine).
"""

from __future__ import annotations


class NanoqwenError(Exception):
    """Base of the errors below."""


class ConfigError(NanoqwenError, ValueError):
    """A model configuration that nanoqwen cannot run."""


class NanoqwenFormatError(NanoqwenError, ValueError):
    """The file is not a valid .nanoqwen file; the message says what is wrong and where."""


class CheckpointError(NanoqwenError, ValueError):
    """A checkpoint that cannot be converted; the message names the file or tensor."""


class GenerationError(NanoqwenError, ValueError):
    """A generation request the engine cannot serve; the message names the argument at fault."""


class ContextLengthError(GenerationError):
    """prompt + max_new_tokens does not fit the model's context or the engine's KV cache."""


class KVCacheFullError(NanoqwenError, RuntimeError):
    """The pool has fewer free pages than a request asked for."""


class BackendUnavailableError(NanoqwenError, RuntimeError):
    """The requested backend cannot run here (no CuPy, no GPU, no CUDA backend)."""


class LaunchError(NanoqwenError, RuntimeError):
    """cuLaunchKernelEx returned an error; the message names the kernel and the CUresult."""


def shown(value, width: int = 40) -> str:
    """`value` for a message, cut to `width` characters; an integer too large to print in full
    (str() refuses past 4,300 digits) by its size."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length():,} bits"
    return f"{value!r:.{width}}"
