"""Tune the INT4 GEMVs' ring depths and split-K target inside the real decode step.

Isolated, a GEMV's best ring depth is not its best depth in the step: there, programmatic
dependent launch lets each GEMV fill its ring while the kernel before it still runs (chapter 6),
and the kernels share the GPU's memory system. So this times the captured decode graph itself,
after a 512-token prompt, for each combination of
    NQ_GATE_UP_STAGES   ring slots of gemv_int4_gate_up_silu          (compile time)
    NQ_SPLIT_K_STAGES   ring slots of the split-K GEMVs (qkv, o, down) (compile time)
    warps per SM        the split-K target of backend_cuda.gemv_splits  (launch time)
    groups per split    the least input groups a split keeps            (launch time)
    gate+up splits      warps per 16-row tile of gemv_int4_gate_up_silu (launch time)
    carve-out           the preferred share of each SM's shared memory capacity, in percent, set
                        on the split-K GEMVs (-1: the driver's choice; the engine's default is 50); it caps how
                        many of their blocks an SM holds at once
swapping only the four GEMV kernels and the splits of one CudaBackend. Rounds alternate the
variants, so drift shows as spread, not as a difference. Every variant's logits are compared with
the first one's: equal bit for bit when the splits are the same (the ring depth changes no sum).

    python3 -m nanoqwen.random_model /tmp/q7b.nanoqwen --preset qwen2.5-coder-7b
    PYTHONPATH=. python3 tools/sweep_gemv_stages.py /tmp/q7b.nanoqwen --json sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoqwen import cuda_build  # noqa: E402
from nanoqwen.backend_cuda import (  # noqa: E402
    GATE_UP_SPLITS, GEMV_KERNELS, GEMV_WARPS_PER_SM, MIN_GROUPS_PER_SPLIT, SPLIT_K_CARVEOUT_PERCENT, CudaBackend,
    fit_gemv_rings, gemv_splits, set_carveout,
)
from nanoqwen.bench import STEP_PROMPT_TOKENS as PROMPT_TOKENS  # noqa: E402
from nanoqwen.bench import TIMING_STEPS, prompted_backend, report_step_timings, time_decode_steps  # noqa: E402
from nanoqwen.cuda_launch import StepKernel  # noqa: E402
from nanoqwen.loader import load  # noqa: E402

GEMV_KERNEL_NAMES = (*GEMV_KERNELS.values(), "gemv_int4_gate_up_silu")


def use_variant(backend: CudaBackend, module, warps_per_sm: int, min_groups: int, gate_up_splits: int,
                carveout: int) -> None:
    """Point `backend` at this module's GEMV kernels, this split-K target and this carve-out; the
    decode graph is captured again at its next use."""
    c = backend.config
    for name in GEMV_KERNEL_NAMES:
        backend.kernels[name] = StepKernel(module.get_function(name), name)
    for name in GEMV_KERNELS.values():  # the ring bytes follow the module's stages
        set_carveout(backend.kernels[name], carveout)
        backend.split_k_ring_bytes = fit_gemv_rings(backend.kernels[name], module, name)
    backend.gate_up_ring_bytes = fit_gemv_rings(backend.kernels["gemv_int4_gate_up_silu"], module, "gemv_int4_gate_up_silu")
    backend.gate_up_splits = gate_up_splits
    for linear in backend._linears():
        linear.splits = gemv_splits(linear.out_features, linear.in_features, backend.num_sms, c.group_size, warps_per_sm,
                                    min_groups)
    backend._graph = None
    backend.forget_step_inputs()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .nanoqwen file (a 7B-shaped one: nanoqwen.random_model)")
    parser.add_argument("--gate-up-stages", type=int, nargs="+", default=[4, 5, 6, 7, 8])
    parser.add_argument("--split-k-stages", type=int, nargs="+", default=[3, 4, 5, 6])
    parser.add_argument("--warps-per-sm", type=int, nargs="+", default=[GEMV_WARPS_PER_SM])
    parser.add_argument("--min-groups", type=int, nargs="+", default=[MIN_GROUPS_PER_SPLIT])
    parser.add_argument("--gate-up-splits", type=int, nargs="+", default=[GATE_UP_SPLITS])
    parser.add_argument("--carveout", type=int, nargs="+", default=[SPLIT_K_CARVEOUT_PERCENT])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every timing here")
    args = parser.parse_args(argv)

    model = load(args.model)
    c = model.config
    backend, page_table = prompted_backend(model)

    variants = list(itertools.product(args.gate_up_stages, args.split_k_stages, args.warps_per_sm, args.min_groups,
                                      args.gate_up_splits, args.carveout))
    modules = {}
    for gate_up, split_k, *_ in variants:
        if (gate_up, split_k) not in modules:
            modules[gate_up, split_k] = cuda_build.compile_module(
                c, files=("gemv_int4.cu",),
                extra_defines={"NQ_GATE_UP_STAGES": str(gate_up), "NQ_SPLIT_K_STAGES": str(split_k)})
    times = {v: [] for v in variants}
    reference, logit_diff = None, {}
    for _ in range(args.rounds):
        for variant in variants:
            gate_up, split_k, warps, min_groups, gate_up_splits, carveout = variant
            use_variant(backend, modules[gate_up, split_k], warps, min_groups, gate_up_splits, carveout)
            logits = backend.decode(1, PROMPT_TOKENS, page_table)
            if reference is None:
                reference = logits
            logit_diff[variant] = float(np.abs(logits - reference).max())
            graph = backend.decode_graph()
            times[variant].append(time_decode_steps(backend, graph.launch, TIMING_STEPS, PROMPT_TOKENS, page_table))
    rows = [{"gate_up_stages": v[0], "split_k_stages": v[1], "warps_per_sm": v[2], "min_groups": v[3],
             "gate_up_splits": v[4], "carveout": v[5],
             "splits": {name: gemv_splits(n, k, backend.num_sms, c.group_size, v[2], v[3]) for name, (n, k) in
                        (("qkv", (c.q_dim + 2 * c.kv_dim, c.hidden_size)), ("o", (c.hidden_size, c.q_dim)),
                         ("down", (c.hidden_size, c.intermediate_size)))},
             "ms_per_step": statistics.median(times[v]), "runs_ms": times[v], "max_logit_diff": logit_diff[v]}
            for v in variants]
    rows.sort(key=lambda r: r["ms_per_step"])
    report_step_timings(
        "tools/sweep_gemv_stages.py", argv or sys.argv[1:], rows,
        ["gate+up stages", "split-K stages", "warps/SM", "min groups", "gate+up splits", "splits qkv/o/down",
         "carve-out", "ms per step (median)", "spread", "max logit diff vs first"],
        [[r["gate_up_stages"], r["split_k_stages"], r["warps_per_sm"], r["min_groups"], r["gate_up_splits"],
          "/".join(str(r["splits"][n]) for n in ("qkv", "o", "down")), r["carveout"], f"{r['ms_per_step']:.4f}",
          f"{max(r['runs_ms']) - min(r['runs_ms']):.4f}", f"{r['max_logit_diff']:.2e}"] for r in rows],
        args.json)
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
