"""The backends the engine runs on, and which one a machine can run.

A backend owns a model's weights on its device and the KV pool; the engine drives it through the
`Backend` protocol. `NumpyBackend` (nanoqwen.reference) runs anywhere; `CudaBackend`
(nanoqwen.cuda) needs CuPy and a Hopper GPU. Nothing here imports CuPy until a CUDA backend is
asked for.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from .config import ModelConfig
from .cuda.weights import PREFILL_WEIGHTS
from .errors import BackendUnavailableError, GenerationError
from .loader import Model
from .sampling import GREEDY, SamplingParams

__all__ = ["BACKENDS", "Backend", "cuda_available", "cuda_unavailable_reason", "make_backend"]

BACKENDS = ("auto", "numpy", "cuda")


class Backend(Protocol):
    """What the engine needs from a backend. Both `NumpyBackend` and `CudaBackend` provide it.

    A backend owns the model's weights on its device and the KV pool of `num_pages` pages; the
    engine owns the page tables. Token ids and page tables are int32 host arrays.
    """

    name: str
    config: ModelConfig
    num_pages: int

    def prefill(self, token_ids: np.ndarray, start_pos: int, page_table: np.ndarray) -> np.ndarray:
        """Write K/V of token_ids [T] at positions start_pos..start_pos+T-1; fp32 logits [vocab] of the last."""

    def decode(self, token_id: int, position: int, page_table: np.ndarray) -> np.ndarray:
        """One token at `position` (reads positions 0..position); fp32 logits [vocab]."""

    def decode_next(self, token_id: int, position: int, page_table: np.ndarray,
                    sampling: SamplingParams = GREEDY) -> int:
        """The token `sampling` chooses from `decode`'s logits (`sample` at `position`); a backend
        may choose it without bringing the logits to the host."""

    def next_tokens(self, token_id: int, position: int, page_table: np.ndarray, steps: int,
                    sampling: SamplingParams = GREEDY) -> Iterator[int]:
        """The next `steps` tokens after `token_id` at `position`, each chosen by `sampling` and fed
        back in turn. A backend may compute one step ahead of its consumer (CudaBackend.next_tokens).
        A consumer that wants no more steps started sends True instead of asking for the next
        token: the generator then yields the token of a step already running ahead, if there is
        one, and stops (StopIteration at once when there is none)."""

    def verify(self, token_id: int, drafts: Sequence[int], position: int, page_table: np.ndarray,
               sampling: SamplingParams = GREEDY) -> list[int]:
        """One pass over the weights for rows [token_id, *drafts] at positions position..position +
        len(drafts) (at most MAX_DRAFTS drafts; the page table covers those positions and may end
        there): each row writes its K/V and attends causally over the cache and the rows before it.
        Row j's token is `sample(logits_j, sampling, position + j)`, as `decode_next` would choose
        it at that position. Returns the chosen tokens up to and including the first that differs
        from its draft (1..len(drafts) + 1 tokens; `nanoqwen.speculative.accepted_tokens`). A
        backend may choose and compare on the device and bring back only the accepted tokens.

        The K/V rows of rejected drafts stay in the cache, stale: the next pass starts at the
        first position not accepted and writes its rows before attending, and no row attends past
        its own position, so a stale row is overwritten before anything reads it."""


# The attention kernels use cp.async.bulk copies and mbarrier transaction counts: Hopper (9.0) on.
MIN_COMPUTE_CAPABILITY = 90


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here, or None when it can."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'nanoqwen[cuda12]' or '[cuda13]')"
    if importlib.util.find_spec("nanoqwen.cuda.backend") is None:
        return "this nanoqwen has no nanoqwen.cuda.backend module"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "CuPy sees no NVIDIA GPU"
        capability = int(cupy.cuda.Device(0).compute_capability)  # "90" on an H100/H200
    except Exception as e:  # CuPy raises its own error types when the driver or device is missing
        return f"CuPy cannot reach a GPU ({type(e).__name__}: {e})"
    if capability < MIN_COMPUTE_CAPABILITY:
        return (
            f"GPU 0 has compute capability {capability // 10}.{capability % 10}; the CUDA backend needs "
            f"{MIN_COMPUTE_CAPABILITY // 10}.0 or newer (Hopper: its attention kernels use cp.async.bulk "
            "and mbarrier transaction counts)"
        )
    return None


def cuda_available() -> bool:
    """True when CuPy imports, sees a Hopper-or-newer GPU, and the CUDA backend module exists."""
    return cuda_unavailable_reason() is None


def make_backend(name: str, model: Model, num_pages: int, activations: str = "fp16",
                 prefill_weights: str = "auto") -> Backend:
    if activations not in ("fp16", "int8"):
        raise GenerationError(f"activations must be 'fp16' or 'int8', got {activations!r:.80}")
    if prefill_weights not in PREFILL_WEIGHTS:
        raise GenerationError(f"prefill_weights must be one of {', '.join(PREFILL_WEIGHTS)}, got {prefill_weights!r:.80}")
    if name not in BACKENDS:
        raise GenerationError(f"unknown backend {name!r:.80}: choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "cuda" if cuda_available() else "numpy"
    if name == "numpy":
        from .reference.backend import NumpyBackend

        if activations != "fp16":
            raise BackendUnavailableError("INT8 activations (chapter 8's Path A) exist on the CUDA backend only")
        if prefill_weights == "cache":
            raise BackendUnavailableError("prefill_weights='cache' (fp16 copies for cuBLAS) exists on the CUDA backend only")
        return NumpyBackend(model, num_pages)
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"backend 'cuda' cannot run here: {reason}; use --backend numpy to run on the CPU")
    from .cuda.backend import CudaBackend

    return CudaBackend(model, num_pages, activations=activations, prefill_weights=prefill_weights)
