"""Where a decode step's time goes: per-kernel in-graph costs, the step's launch timeline, the
graph with and without programmatic dependent launch. `nanoqwen bench` and the tools in tools/
that write results/ records are built from these.

Every time here is GPU time from CUDA events (nanoqwen.cuda.timing), except `time_host_loop`,
which is what a user waits: wall-clock time per step of steps issued back to back.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections import defaultdict

import numpy as np

from .graph import DecodeGraph, capture
from .launch import driver_module
from .timing import gpu_ms

EMPTY_KERNEL = r"""
extern "C" __global__ void empty_kernel() { }
"""
TIMING_STEPS = 64  # decode steps each step-level timing runs past the prompt
STEP_PROMPT_TOKENS = 512  # the protocol's prompt: the context every step-level timing starts from
PDL_ROUNDS = 3  # alternations of the PDL and plain graphs; each figure is the median over rounds


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
        # Path A's projections (chapter 8) launch kernels of their own.
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
    """Median GPU time (us) of one replay of a graph capturing `issue()` (the first replay, which
    pays for instantiation and cold caches, untimed)."""
    graph = capture(stream, issue)
    return gpu_ms(stream, lambda: graph.launch(stream), replays) * 1e3


def launch_costs(backend, replays: int = 20, launches=None) -> tuple[dict[str, float], list[str]]:
    """In-graph cost (us per launch) of each kernel of one decode step (or of `launches(stream)`,
    another fixed launch sequence of the backend's, such as a verify pass), by kernel name.

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
    with LaunchRecorder(backend) as recorder:  # one eager run to learn the launch sequence
        (launches or backend.decode_step_launches)(stream)
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


def launch_timeline(backend) -> tuple[list[tuple[str, float, float]], float]:
    """One decode step laid out in launch order, each launch as long as its in-graph cost.

    Returns ([(name, start_us, end_us)], empty-kernel cost in us per launch).
    """
    costs, order = launch_costs(backend)
    timeline, clock = [], 0.0
    for name in order:
        timeline.append((name, clock, clock + costs[name]))
        clock += costs[name]
    return timeline, empty_launch_cost(backend.stream, len(order))


def kernel_table(timeline) -> list[dict]:
    per_kernel = defaultdict(lambda: [0, 0.0])
    for name, start, end in timeline:
        per_kernel[name][0] += 1
        per_kernel[name][1] += end - start
    total = sum(t for _, t in per_kernel.values())
    return [
        {"kernel": name, "launches": n, "us": round(t, 1), "us_per_launch": round(t / n, 2), "share": round(t / total, 4)}
        for name, (n, t) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
    ]


def time_decode_steps(backend, step, steps: int, start_position: int, page_table) -> float:
    """Median ms of `steps` replays of `step()` (each one decode step), GPU-timed per step."""
    backend.set_step_inputs(1, start_position, page_table)
    return gpu_ms(backend.stream, step, steps, warmup=0)


def time_host_loop(backend, step, steps: int, start_position: int, page_table) -> float:
    """Wall-clock ms per step of `steps` steps issued back to back (what a user waits)."""
    backend.set_step_inputs(1, start_position, page_table)
    backend.stream.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    backend.stream.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def prompted_backend(model, prompt_tokens: int = STEP_PROMPT_TOKENS):
    """A CudaBackend of `model` holding a random prompt of `prompt_tokens` tokens, with pages for
    TIMING_STEPS decode steps after it: where the step-level tools (tools/step_timeline.py) start.
    Prefill dequantizes per prompt, so no fp16 copies take memory.
    Returns (backend, page_table)."""
    from ..kvcache import pages_needed
    from .backend import CudaBackend

    pages = pages_needed(prompt_tokens + TIMING_STEPS + 1)
    backend = CudaBackend(model, num_pages=pages, prefill_weights="expand")
    page_table = np.arange(pages, dtype=np.int32)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, prompt_tokens).astype(np.int32)
    backend.prefill(prompt, 0, page_table)
    return backend, page_table


def step_launch_names(backend) -> list[str]:
    """The kernel of every launch of one decode step of a CudaBackend, in launch order, the
    attention object's two kernels included; nothing is launched."""
    names = []
    kept = dict(backend.kernels)
    attention = backend.attention
    kept_attention = (attention._decode, attention._combine)

    def recorder(name):
        return lambda *args, **kwargs: names.append(name)

    try:
        for name in kept:
            backend.kernels[name] = recorder(name)
        attention._decode, attention._combine = recorder(attention.decode_kernel), recorder("paged_attention_combine")
        backend.decode_step_launches(backend.stream)
    finally:
        backend.kernels.update(kept)
        attention._decode, attention._combine = kept_attention
    return names


def step_timing_record(tool: str, argv: list[str], rows: list[dict], prompt_tokens: int = STEP_PROMPT_TOKENS,
                       steps: int = TIMING_STEPS) -> dict:
    """A step-level tool's rows with where and when they were measured (UTC date and minute, the
    GPU's name, the command) and the protocol they start from (each timing `steps` decode steps
    after a prompt of `prompt_tokens`), ready for results/."""
    import cupy as cp

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(),
        "command": " ".join([tool, *argv]),
        "prompt_tokens": prompt_tokens,
        "steps_per_timing": steps,
        "rows": rows,
    }


def pdl_comparison(backend, start_position: int, page_table, rounds: int = PDL_ROUNDS) -> dict:
    """The decode step captured twice, with programmatic dependent launch and without, timed in
    alternation in the same run: GPU events per step and a host loop per token for each."""
    graphs = {"on": DecodeGraph(backend, pdl=True), "off": DecodeGraph(backend, pdl=False)}
    result = {"engine_graph": backend.decode_graph().mode, "pdl_graph": graphs["on"].mode}
    if not graphs["on"].pdl:
        return {**result, "measured": False, "reason": driver_module()[1]}
    gpu, wall = {"on": [], "off": []}, {"on": [], "off": []}
    for _ in range(rounds):
        for name in ("off", "on"):
            launch = graphs[name].launch
            gpu[name].append(time_decode_steps(backend, launch, TIMING_STEPS, start_position, page_table))
            wall[name].append(time_host_loop(backend, launch, TIMING_STEPS, start_position, page_table))
    result.update(measured=True, rounds=rounds)
    for name in ("on", "off"):
        result[f"graph_ms_per_step_gpu_{name}"] = statistics.median(gpu[name])
        result[f"graph_ms_per_token_wall_{name}"] = statistics.median(wall[name])
    result["saving_us_per_step_gpu"] = (result["graph_ms_per_step_gpu_off"] - result["graph_ms_per_step_gpu_on"]) * 1e3
    return result
