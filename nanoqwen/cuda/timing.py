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
