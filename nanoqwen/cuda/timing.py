"""GPU time of a piece of work, measured with CUDA events: the one timing loop every benchmark,
tool and chapter uses.

Device work is asynchronous, so the host clock says nothing about it: an event is recorded on the
stream before and after each repeat, and the time between them is the GPU's. The first calls
(`warmup`) pay for module loads, graph instantiation and cold caches and are not counted.

    median_ms = gpu_ms(stream, lambda: graph.launch(stream), repeats=50)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np


def gpu_times_ms(stream, issue: Callable[[], object], repeats: int, warmup: int = 1,
                 prepare: Callable[[], object] | None = None) -> list[float]:
    """Milliseconds of GPU time of each of `repeats` calls of `issue()` (which enqueues work on
    `stream`), after `warmup` calls that are not timed. `prepare()`, when given, enqueues untimed
    work before each timed call (a kernel that keeps the GPU busy while the host queues the next)."""
    import cupy as cp

    for _ in range(warmup):
        issue()
    times = []
    for _ in range(repeats):
        if prepare is not None:
            prepare()
        begin, end = cp.cuda.Event(), cp.cuda.Event()
        begin.record(stream)
        issue()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(begin, end))
    return times


def gpu_ms(stream, issue: Callable[[], object], repeats: int, warmup: int = 1,
           prepare: Callable[[], object] | None = None) -> float:
    """The median of `gpu_times_ms`."""
    return statistics.median(gpu_times_ms(stream, issue, repeats, warmup, prepare))


# A read-only stream: every thread reads 16-byte pieces a grid apart and keeps their xor, so the
# loads cannot be dropped; one word per thread is written, which is nothing beside the reads.
_READ_STREAM = r"""
extern "C" __global__ void read_stream(const uint4* __restrict__ data, long long pieces, unsigned* out) {
  unsigned acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < pieces; i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = __ldg(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
"""
READ_STREAM_BYTES = 2 << 30  # far past any L2, so every byte comes from device memory


def read_bandwidth(repeats: int = 10) -> float:
    """The device's read bandwidth in bytes/s, as a decode step reads its weights: a 2 GiB buffer of
    random bytes streamed once per repeat with 16-byte loads (median). The byte floors of the GPU
    records divide by it. Its buffers go back to the driver before it returns: left in CuPy's pool,
    later small arrays would split them, and the rest would stay cached for the current stream only
    (nanoqwen.cuda.device.free_device_bytes)."""
    import cupy as cp

    ms = _read_stream_ms(repeats)
    cp.get_default_memory_pool().free_all_blocks()
    return READ_STREAM_BYTES / (ms / 1e3)


def _read_stream_ms(repeats: int) -> float:
    """Median ms of one pass of read_stream over READ_STREAM_BYTES; its buffers are freed at return."""
    import cupy as cp

    kernel = cp.RawKernel(_READ_STREAM, "read_stream")
    data = cp.random.randint(0, 2**31, READ_STREAM_BYTES // 4, dtype=cp.int32)
    blocks, threads = cp.cuda.Device().attributes["MultiProcessorCount"] * 8, 256
    out = cp.empty(blocks * threads, dtype=cp.uint32)
    stream = cp.cuda.get_current_stream()
    pieces = np.int64(READ_STREAM_BYTES // 16)
    return gpu_ms(stream, lambda: kernel((blocks,), (threads,), (data, pieces, out)), repeats, warmup=2)
