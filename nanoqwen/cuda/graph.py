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

from .launch import programmatic_launches

EMPTY_KERNEL = r"""
extern "C" __global__ void empty_kernel() { }
"""


def capture(stream, issue):
    """A CUDA graph of the launches `issue()` makes on `stream`, uploaded and ready to launch.

    If `issue` fails, the capture is ended and the original error raised (ending an
    invalidated capture raises an error of its own, which would otherwise hide the cause).
    """
    with stream:
        stream.begin_capture()
        try:
            issue()
        except BaseException:
            try:
                stream.end_capture()
            except Exception:
                pass
            raise
        graph = stream.end_capture()
    graph.upload(stream)
    return graph


class DecodeGraph:
    """`backend.decode_step_launches` captured once on `backend.stream`; `launch()` replays it.

    With `pdl`, every kernel of the step that waits for its predecessor in the kernel itself
    (nanoqwen.cuda.launch.KERNELS_THAT_WAIT) is captured as a programmatic dependent launch, so
    it may start while the kernel before it finishes. `self.pdl` says whether that happened
    (False where cuda.bindings is missing: the launches are then plain, after one warning).
    """

    def __init__(self, backend, pdl: bool = False):
        self.stream = backend.stream
        self.launches = backend.launches_per_token
        with programmatic_launches(pdl) as self.pdl:
            self.graph = capture(self.stream, lambda: backend.decode_step_launches(self.stream))

    @property
    def mode(self) -> str:
        return "pdl" if self.pdl else "plain"

    def launch(self) -> None:
        self.graph.launch(self.stream)


class LaunchRecorder:
    """Records the launches of one decode step by name, so that each can be re-issued alone.

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
        self._decode_was_instance_attribute = "decode" in vars(backend.attention)
        for name, kernel in self._kernels.items():
            backend.kernels[name] = self._wrap(name, kernel)
        backend.attention.decode = self._wrap("attention_decode", self._attention_decode)
        # Path A's projections (chapter 7) launch kernels of their own.
        self._int8 = [gemv for layer in (getattr(backend, "int8_layers", None) or ()) for gemv in layer.values()]
        for gemv in self._int8:
            gemv._quantize_kernel = self._wrap("quantize_activations_int8", gemv._quantize_kernel)
            gemv._gemv_kernel = self._wrap("gemv_int4_int8", gemv._gemv_kernel)
        return self

    def _wrap(self, name, launch):
        def recorded(*args, **kwargs):
            self.launches.append((name, lambda: launch(*args, **kwargs)))
            return launch(*args, **kwargs)

        recorded.launch = launch  # the original, for __exit__
        return recorded

    def __exit__(self, *exc) -> None:
        self.backend.kernels.clear()
        self.backend.kernels.update(self._kernels)
        if self._decode_was_instance_attribute:
            self.backend.attention.decode = self._attention_decode
        else:
            del self.backend.attention.decode  # ours hid the class's method
        for gemv in self._int8:
            gemv._quantize_kernel = gemv._quantize_kernel.launch
            gemv._gemv_kernel = gemv._gemv_kernel.launch


def _graph_time_us(stream, issue, replays: int) -> float:
    """Median GPU time (us) of one replay of a graph capturing `issue()`."""
    import statistics

    import cupy as cp

    graph = capture(stream, issue)
    graph.launch(stream)  # warm: first replays pay for instantiation and cold caches
    times = []
    for _ in range(replays):
        begin, end = cp.cuda.Event(), cp.cuda.Event()
        begin.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(begin, end) * 1e3)
    return statistics.median(times)


def launch_costs(backend, replays: int = 20) -> tuple[dict[str, float], list[str]]:
    """In-graph cost (us per launch) of each kernel of one decode step, by kernel name.

    All launches of one name (28 GEMVs over 28 layers' different weights, say) are captured
    in step order into a graph of their own, so each reads its own bytes from HBM as in the
    real step; the graph's time over its launch count is that kernel's cost, its share of the
    gaps between launches included. A kernel launched once per step is captured four times.
    The device state as it was before the call is restored before each graph (argmax_select_next
    advances it) and at the end; K/V rows at the state's position are overwritten.
    """
    stream = backend.stream
    with stream:
        snapshot = backend.state.copy()
    with LaunchRecorder(backend) as recorder:  # one eager step to learn the launch sequence
        backend.decode_step_launches(stream)
    by_name: dict[str, list] = {}
    for name, thunk in recorder.launches:
        by_name.setdefault(name, []).append(thunk)
    costs = {}
    for name, thunks in by_name.items():
        copies = 4 if len(thunks) == 1 else 1
        with stream:
            backend.state[...] = snapshot
        total = _graph_time_us(stream, lambda: [t() for _ in range(copies) for t in thunks], replays)
        costs[name] = total / (copies * len(thunks))
    with stream:
        backend.state[...] = snapshot
    stream.synchronize()
    backend.forget_step_inputs()
    return costs, [name for name, _ in recorder.launches]


def empty_launch_cost(stream, launches: int = 256, replays: int = 20) -> float:
    """us per launch of an empty kernel inside a graph: the floor of the gap between kernels."""
    import cupy as cp

    kernel = cp.RawKernel(EMPTY_KERNEL, "empty_kernel")
    return _graph_time_us(stream, lambda: [kernel((1,), (32,), ()) for _ in range(launches)], replays) / launches


def step_timeline(backend) -> tuple[list[tuple[str, float, float]], float]:
    """One decode step laid out in launch order, each launch as long as its in-graph cost.

    Returns ([(name, start_us, end_us)], empty-kernel cost in us per launch).
    """
    costs, order = launch_costs(backend)
    timeline, clock = [], 0.0
    for name in order:
        timeline.append((name, clock, clock + costs[name]))
        clock += costs[name]
    return timeline, empty_launch_cost(backend.stream, len(order))
