"""The deliberately broken decode attention: a race, built on purpose (chapter 5).

`BrokenPagedAttention` is `nanoqwen.cuda.attention.PagedAttention` with its decode kernel taken
from kernels/paged_attention_broken.cu, whose stage hand-off puts the synchronous kernel's one
`__syncthreads()` inside the producer warp's branch. tools/gpu_check_attention.py runs it under
stress and under compute-sanitizer; the engine never builds it.
"""

from __future__ import annotations

from ..cuda.attention import PagedAttention

__all__ = ["BROKEN_KERNEL_FILE", "BrokenPagedAttention"]

BROKEN_KERNEL_FILE = "paged_attention_broken.cu"


class BrokenPagedAttention(PagedAttention):
    """The same launches with kernels/paged_attention_broken.cu's decode: a race, on purpose."""

    kernel_file = BROKEN_KERNEL_FILE
    decode_kernel = "paged_attention_decode_broken"
