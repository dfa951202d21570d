"""What each kind of kernel costs inside the decode step: the captured graph timed without it.

`nanoqwen bench` prices each kernel in a graph of its own launches. In the engine's graph,
programmatic dependent launch overlaps every kernel with its neighbours, so what a kernel costs
the step is what the step saves when it is gone. This captures the decode graph whole and once
without each group of launches (their kernel replaced by a no-op while the graph is captured),
on one CudaBackend after a 512-token prompt, and times every graph the same way
(nanoqwen.bench.time_decode_steps, rounds alternating the graphs). Without the removed kernels
the outputs mean nothing; the time saved bounds what fusing the group away could win.

    python3 -m nanoqwen.random_model /tmp/q7b.nanoqwen --preset qwen2.5-coder-7b
    PYTHONPATH=. python3 tools/step_ablation.py /tmp/q7b.nanoqwen --json ablation.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoqwen.cuda.backend import GEMV_KERNELS, QKV_ROPE_KERNEL, CudaBackend  # noqa: E402
from nanoqwen.bench import STEP_PROMPT_TOKENS as PROMPT_TOKENS  # noqa: E402
from nanoqwen.bench import (  # noqa: E402
    TIMING_STEPS, prompted_backend, report_step_timings, step_launch_names, time_decode_steps,
)
from nanoqwen.loader import load  # noqa: E402
# group name -> kernels left out of the captured step ("attention" is the attention object's decode)
GROUPS = {
    "gate+up GEMV (SwiGLU fused)": ["gemv_int4_gate_up_silu"],
    "down GEMV": [GEMV_KERNELS["down"]],
    "q|k|v GEMV": [GEMV_KERNELS["qkv"], QKV_ROPE_KERNEL],  # with RoPE, where the engine fuses it
    "o GEMV": [GEMV_KERNELS["o"]],
    "attention": ["attention"],
    "add_rmsnorm": ["add_rmsnorm_cluster"],
    "rope_write_kv": ["rope_write_kv"],
    "lm_head + argmax": ["lm_head_logits", "argmax_select_next"],
    "embed_tokens": ["embed_tokens"],
}


def _skip(*args, **kwargs) -> None:
    """Stands in for a launch that the ablated graph leaves out."""


@contextlib.contextmanager
def without(backend: CudaBackend, names: list[str]):
    """`backend` issues no launch of `names` until the block ends."""
    kept = {name: backend.kernels[name] for name in names if name != "attention"}
    try:
        for name in kept:
            backend.kernels[name] = _skip
        if "attention" in names:
            backend.attention.decode = _skip  # an instance attribute shadows the method
        yield
    finally:
        backend.kernels.update(kept)
        if "attention" in names:
            del backend.attention.decode


def launches_of(backend: CudaBackend, names: list[str]) -> int:
    """How many launches of `names` ("attention": the attention object's two kernels) one decode step makes."""
    kernels = set(names) - {"attention"}
    if "attention" in names:
        kernels |= {backend.attention.decode_kernel, "paged_attention_combine"}
    return sum(name in kernels for name in step_launch_names(backend))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .nanoqwen file (a 7B-shaped one: nanoqwen.random_model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every timing here")
    args = parser.parse_args(argv)

    model = load(args.model)
    backend, page_table = prompted_backend(model)

    variants = {"whole step": []} | {f"without {group}": names for group, names in GROUPS.items()
                                     if launches_of(backend, names)}  # rope_write_kv: only with rope_in_qkv off
    graphs = {}
    for variant, names in variants.items():
        backend._graph = None  # capture anew, without `names`
        with without(backend, names):
            graphs[variant] = backend.decode_graph()
    backend._graph = None
    times = {variant: [] for variant in variants}
    for _ in range(args.rounds):
        for variant, graph in graphs.items():
            times[variant].append(time_decode_steps(backend, graph.launch, TIMING_STEPS, PROMPT_TOKENS, page_table))
    backend.forget_step_inputs()

    whole = statistics.median(times["whole step"])
    rows = []
    for variant, names in variants.items():
        ms = statistics.median(times[variant])
        launches = launches_of(backend, names) if names else 0
        saved_us = (whole - ms) * 1e3
        rows.append({"variant": variant, "ms_per_step": ms, "runs_ms": times[variant], "launches_removed": launches,
                     "saved_us": saved_us, "saved_us_per_launch": saved_us / launches if launches else None})
    report_step_timings(
        "tools/step_ablation.py", argv or sys.argv[1:], rows,
        ["graph", "ms per step (median)", "saved µs", "launches left out", "saved µs per launch"],
        [[r["variant"], f"{r['ms_per_step']:.4f}", f"{r['saved_us']:.0f}", r["launches_removed"],
          "" if r["saved_us_per_launch"] is None else f"{r['saved_us_per_launch']:.2f}"] for r in rows],
        args.json)
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
