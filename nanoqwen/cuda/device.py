"""Host memory and driver settings the CUDA backend needs beyond CuPy's arrays.

Pinned, mapped host rows that a kernel stores to directly (the decode state's head, so the host
reads each step's token without a copy in the stream); the device memory a new allocation can get;
a kernel's shared-memory carve-out and its dynamic shared memory; the size of a persistent grid.
"""

from __future__ import annotations

import numpy as np

from . import build
from .plan import GEMV_MAX_WARPS, SmBudget

NULL = np.uint64(0)  # a null pointer kernel argument


def mapped_host_array(shape, dtype) -> tuple[np.ndarray, object]:
    """A numpy array in pinned host memory that kernels can write directly (mapped, zero-copy: with
    unified addressing, which every 64-bit CUDA platform has, its host address is also its device
    address). Returns (array, memory); the array is valid while `memory` is alive."""
    import ctypes

    import cupy as cp

    runtime = cp.cuda.runtime
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    memory = cp.cuda.PinnedMemory(nbytes, runtime.hostAllocMapped | runtime.hostAllocPortable)
    array = np.frombuffer((ctypes.c_byte * nbytes).from_address(memory.ptr), dtype=dtype).reshape(shape)
    return array, memory


def free_device_bytes() -> int:
    """Device memory an allocation on any stream can still get: the driver's free memory once CuPy's
    pool has handed its cached blocks back. A cached block the pool keeps after that is the free
    part of a split block, which only the stream that freed it reuses, so it is not counted: a
    large block freed on the default stream and then split by small arrays there is no use to the
    backend's stream."""
    import cupy as cp

    cp.get_default_memory_pool().free_all_blocks()
    free, _ = cp.cuda.runtime.memGetInfo()
    return free


def fit_gemv_rings(kernel, module, name: str) -> int:
    """Let GEMV `kernel` (`module`'s `name`) take the dynamic shared memory of its largest block,
    one ring per warp; returns one warp's ring bytes, which gemv_launch takes."""
    ring_bytes = build.module_int(module, f"{name}_ring_bytes")
    kernel.max_dynamic_shared_size_bytes = GEMV_MAX_WARPS[name] * ring_bytes
    return ring_bytes


def sm_budget(device) -> SmBudget:
    """What one SM of `device` (a cupy.cuda.Device) holds at once, for the plan's residency counts."""
    attributes = device.attributes
    return SmBudget(registers=attributes["MaxRegistersPerMultiprocessor"],
                    threads=attributes["MaxThreadsPerMultiProcessor"],
                    blocks=attributes["MaxBlocksPerMultiprocessor"],
                    shared_bytes=attributes["MaxSharedMemoryPerMultiprocessor"])


def set_carveout(kernel, percent: int) -> None:
    """Ask the driver to split each SM's L1/shared capacity so that `percent` of it is shared
    memory whenever `kernel` runs (-1: the driver's choice)."""
    import cupy as cp

    cp.cuda.driver.funcSetAttribute(kernel.kernel.ptr, cp.cuda.driver.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                    percent)


def persistent_blocks(kernel, threads: int, num_sms: int) -> int:
    """Blocks of a persistent kernel: as many as can be resident on the GPU at once."""
    import cupy as cp

    per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, threads, 0)
    return max(1, per_sm) * num_sms
