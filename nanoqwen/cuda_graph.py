"""The decode step as one CUDA graph, and the tools to see where its time goes.

Launching a kernel from Python costs several microseconds of host time; a 7B decode step is
about 250 launches, so an eager step is bound by the host, not the GPU. A CUDA graph records
the step's launches once and replays them with one call. Three rules make that legal here:

* nothing inside the step allocates, synchronises or copies to the host;
* every kernel argument is frozen at capture, so the values that change per token (token id,
  position, sequence length, page table) live in device memory (`CudaBackend.state`) and the
  last kernel of the step (argmax_select_next) advances them for the next replay;
* pages for the whole request are reserved before decoding starts, so a step that crosses into
  a new page needs no host decision: the page table already names it.

The article this book grew from captured two graph variants and chose one per token depending
on whether the token opened a new page. Keeping the page table and position in device memory
makes that choice unnecessary: one graph serves every step.
"""

from __future__ import annotations

import numpy as np

SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    // Hold the stream for `cycles` SM clocks, so the host can queue a whole step behind it.
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


class DecodeGraph:
    """`backend.decode_step_launches` captured once on `backend.stream`; `launch()` replays it."""

    def __init__(self, backend):
        stream = backend.stream
        with stream:
            stream.begin_capture()
            try:
                self.launches = backend.decode_step_launches(stream)
            finally:
                graph = stream.end_capture()
        graph.upload(stream)
        self.graph, self.stream = graph, stream

    def launch(self) -> None:
        self.graph.launch(self.stream)


class LaunchRecorder:
    """Records the launches of one decode step by name, so each can be replayed or timed alone.

    It wraps the backend's kernels and its attention object in place while active; on exit the
    originals are restored.
    """

    def __init__(self, backend):
        self.backend = backend
        self.launches: list[tuple[str, object]] = []  # (name, thunk that re-issues the launch)

    def __enter__(self) -> "LaunchRecorder":
        backend = self.backend
        self._kernels = dict(backend.kernels)
        self._attention_decode = backend.attention.decode
        for name, kernel in self._kernels.items():
            backend.kernels[name] = self._wrap(name, kernel)
        backend.attention.decode = self._wrap("attention_decode", self._attention_decode)
        return self

    def _wrap(self, name, launch):
        def recorded(*args, **kwargs):
            self.launches.append((name, lambda: launch(*args, **kwargs)))
            return launch(*args, **kwargs)

        return recorded

    def __exit__(self, *exc) -> None:
        self.backend.kernels.clear()
        self.backend.kernels.update(self._kernels)
        del self.backend.attention.decode  # the instance attribute hid the method


def step_timeline(backend, spin_cycles: int = 40_000_000) -> list[tuple[str, float, float]]:
    """Start and end (us) of every launch of one decode step, measured on the GPU.

    A spin kernel (20-40 ms at Hopper's clocks) holds the stream while the host queues the whole step with an event between
    launches; the GPU then runs the kernels back to back, as a graph would, and the events time
    each one. Returns [(name, start_us, end_us)], starts relative to the first launch.
    """
    import cupy as cp

    stream = backend.stream
    with LaunchRecorder(backend) as recorder:  # one eager step to learn the launch sequence
        backend.decode_step_launches(stream)
    stream.synchronize()
    spin = cp.RawKernel(SPIN_SOURCE, "spin")
    events = [cp.cuda.Event() for _ in range(len(recorder.launches) + 1)]
    with stream:
        spin((1,), (1,), (np.int64(spin_cycles),))
        events[0].record(stream)
        for (name, thunk), event in zip(recorder.launches, events[1:]):
            thunk()
            event.record(stream)
    stream.synchronize()
    timeline, start = [], 0.0
    for (name, _), before, after in zip(recorder.launches, events, events[1:]):
        end = cp.cuda.get_elapsed_time(events[0], after) * 1e3
        timeline.append((name, start, end))
        start = end
    return timeline
