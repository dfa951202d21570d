"""Tune the INT4 GEMVs' ring depths, carve-outs and split-K target inside the real decode step.

Isolated, a GEMV's best ring depth is not its best depth in the step: there, programmatic
dependent launch lets each GEMV fill its ring while the kernel before it still runs (chapter 6),
and the kernels share the GPU's memory system. So this times the captured decode graph itself,
after a 512-token prompt, for each combination of
    stages          ring slots per GEMV (kernels/gemv_int4.cu's NQ_*_STAGES, compile time), as
                    assignments over the kernel's defaults, e.g. "down=6,gate_up=4"
    carve-outs      each GEMV's preferred share of each SM's shared memory capacity, in percent
                    (-1: the driver's choice), over backend_cuda.GEMV_CARVEOUT_PERCENT, e.g. "o=43"
    warps per SM    the split-K target of backend_cuda.gemv_splits, down_proj's rule (launch time)
    groups per split the least input groups a split of it keeps              (launch time)
    gate+up splits  warps per 16-row tile of gemv_int4_gate_up_silu (launch time)
    splits          a split-K GEMV's splits set outright instead of the engine's choice
                    (backend_cuda.projection_splits; down_proj's from the two knobs above),
                    e.g. "qkv=10,o=14" (launch time; up to 16, the warps of one block)
The GEMVs are named qkv, o, down and gate_up. With the ring depth, the carve-out caps how many of
a kernel's blocks an SM holds at once, printed from the occupancy API as blocks/SM: it decides
where the blocks land when they start early, beside the kernel before them.
Only the four GEMV kernels and the splits of one CudaBackend are swapped. Rounds alternate the
variants, so drift shows as spread, not as a difference. Every variant's logits are compared with
the first one's: equal bit for bit when the splits are the same (the ring depth changes no sum).

    python3 -m nanoqwen.random_model /tmp/q7b.nanoqwen --preset qwen2.5-coder-7b
    PYTHONPATH=. python3 tools/sweep_gemv_stages.py /tmp/q7b.nanoqwen --stages down=4 down=6 --json sweep.json
    PYTHONPATH=. python3 tools/sweep_gemv_stages.py /tmp/q7b.nanoqwen --splits "" "qkv=9,o=9" --stages "" "qkv=2,o=2"
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

from nanoqwen.cuda import build  # noqa: E402
from nanoqwen.cuda.backend import (  # noqa: E402
    CHAIN_GEMV_GROUPS_PER_SPLIT, GATE_UP_SPLITS, GEMV_CARVEOUT_PERCENT, GEMV_KERNELS, GEMV_MAX_SPLITS,
    GEMV_STAGES_MACROS, GEMV_WARPS_PER_SM, MIN_GROUPS_PER_SPLIT, CudaBackend, fit_gemv_rings, gemv_launch,
    gemv_splits, projection_splits, set_carveout,
)
from nanoqwen.bench import STEP_PROMPT_TOKENS as PROMPT_TOKENS  # noqa: E402
from nanoqwen.bench import TIMING_STEPS, prompted_backend, report_step_timings, time_decode_steps  # noqa: E402
from nanoqwen.cuda.launch import StepKernel  # noqa: E402
from nanoqwen.loader import load  # noqa: E402

GEMVS = {**GEMV_KERNELS, "gate_up": "gemv_int4_gate_up_silu"}  # short name -> kernel
KNOBS = ("stages", "carveouts", "warps_per_sm", "min_groups", "gate_up_splits", "splits")


def assignments(text: str) -> dict[str, int]:
    """ "down=6,gate_up=4" -> {"gemv_int4_from_intermediate": 6, "gemv_int4_gate_up_silu": 4}"""
    result = {}
    for item in filter(None, text.split(",")):
        short, _, value = item.partition("=")
        if short not in GEMVS or not value.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"expected NAME=INTEGER with NAME one of {', '.join(GEMVS)}, got {item!r}")
        result[GEMVS[short]] = int(value)
    return result


def variant_splits(config, num_sms: int, variant: dict) -> dict[str, int]:
    """Split-K factor of each split-K GEMV (short name) in this variant: set outright, or the
    engine's (`projection_splits`), with down_proj's warps per SM and least groups per split."""
    c = config
    return {short: variant["splits"].get(GEMVS[short])
            or (projection_splits(short, n, k, num_sms, c.group_size) if short in CHAIN_GEMV_GROUPS_PER_SPLIT
                else gemv_splits(n, k, num_sms, c.group_size, variant["warps_per_sm"], variant["min_groups"]))
            for short, (n, k) in c.projection_shapes.items() if short in GEMV_KERNELS}


def blocks_per_sm(backend: CudaBackend, name: str, splits: int) -> int:
    """How many blocks of GEMV `name` at `splits` warps one SM can hold, as the occupancy API says."""
    import cupy as cp

    _, block, shared = gemv_launch(name, 16, splits, backend.gemv_ring_bytes[name])
    return cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(backend.kernels[name].kernel.ptr, block[0], shared)


def use_variant(backend: CudaBackend, module, variant: dict) -> None:
    """Point `backend` at this module's GEMV kernels, this split-K target and these carve-outs; the
    decode graph is captured again at its next use."""
    c = backend.config
    for name in GEMVS.values():  # the ring bytes follow the module's stages
        backend.kernels[name] = StepKernel(module.get_function(name), name)
        set_carveout(backend.kernels[name], {**GEMV_CARVEOUT_PERCENT, **variant["carveouts"]}[name])
        backend.gemv_ring_bytes[name] = fit_gemv_rings(backend.kernels[name], module, name)
    backend.gate_up_splits = variant["gate_up_splits"]
    splits = variant_splits(c, backend.num_sms, variant)
    for layer in backend.layers:
        for short in GEMV_KERNELS:
            getattr(layer, short).splits = splits[short]
    backend._graph = None
    backend.forget_step_inputs()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .nanoqwen file (a 7B-shaped one: nanoqwen.random_model)")
    parser.add_argument("--stages", type=assignments, nargs="+", default=[{}], metavar="NAME=DEPTH,...",
                        help="ring depths over kernels/gemv_int4.cu's defaults, one variant per argument")
    parser.add_argument("--carveouts", type=assignments, nargs="+", default=[{}], metavar="NAME=PERCENT,...",
                        help="carve-outs over backend_cuda.GEMV_CARVEOUT_PERCENT, one variant per argument")
    parser.add_argument("--warps-per-sm", type=int, nargs="+", default=[GEMV_WARPS_PER_SM])
    parser.add_argument("--min-groups", type=int, nargs="+", default=[MIN_GROUPS_PER_SPLIT])
    parser.add_argument("--gate-up-splits", type=int, nargs="+", default=[GATE_UP_SPLITS])
    parser.add_argument("--splits", type=assignments, nargs="+", default=[{}], metavar="NAME=SPLITS,...",
                        help="split-K factors set outright (qkv, o, down; 1-16), one variant per argument")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every timing here")
    args = parser.parse_args(argv)
    for assigned in args.splits:
        for name, value in assigned.items():
            if name == GEMVS["gate_up"] or not 1 <= value <= GEMV_MAX_SPLITS:
                short = next(s for s, kernel in GEMVS.items() if kernel == name)
                parser.error(f"--splits sets qkv, o or down to 1..{GEMV_MAX_SPLITS} warps, got {short}={value}")

    model = load(args.model)
    c = model.config
    backend, page_table = prompted_backend(model)

    variants = [dict(zip(KNOBS, values)) for values in itertools.product(*(getattr(args, knob) for knob in KNOBS))]
    modules = {}  # the stages' defines -> module
    for v in variants:
        key = tuple(sorted(v["stages"].items()))
        if key not in modules:
            modules[key] = build.compile_module(
                c, files=("gemv_int4.cu",),
                extra_defines={GEMV_STAGES_MACROS[name]: str(depth) for name, depth in v["stages"].items()})
    times, reference, logit_diff, capacity = [[] for _ in variants], None, {}, {}
    for _ in range(args.rounds):
        for index, v in enumerate(variants):
            use_variant(backend, modules[tuple(sorted(v["stages"].items()))], v)
            splits = {name: getattr(backend.layers[0], short).splits for short, name in GEMV_KERNELS.items()}
            splits["gemv_int4_gate_up_silu"] = backend.gate_up_splits
            capacity[index] = {short: blocks_per_sm(backend, name, splits[name]) for short, name in GEMVS.items()}
            logits = backend.decode(1, PROMPT_TOKENS, page_table)
            if reference is None:
                reference = logits
            logit_diff[index] = float(np.abs(logits - reference).max())
            graph = backend.decode_graph()
            times[index].append(time_decode_steps(backend, graph.launch, TIMING_STEPS, PROMPT_TOKENS, page_table))
    short_of = {name: short for short, name in GEMVS.items()}

    def named(assigned: dict[str, int]) -> str:
        return ",".join(f"{short_of[name]}={value}" for name, value in assigned.items()) or "defaults"

    rows = [{"stages": named(v["stages"]), "carveouts": named(v["carveouts"]), "warps_per_sm": v["warps_per_sm"],
             "min_groups": v["min_groups"], "gate_up_splits": v["gate_up_splits"],
             "splits": variant_splits(c, backend.num_sms, v),
             "blocks_per_sm": capacity[index], "ms_per_step": statistics.median(times[index]), "runs_ms": times[index],
             "max_logit_diff": logit_diff[index]}
            for index, v in enumerate(variants)]
    rows.sort(key=lambda r: r["ms_per_step"])
    report_step_timings(
        "tools/sweep_gemv_stages.py", argv or sys.argv[1:], rows,
        ["stages", "carve-outs", "warps/SM", "min groups", "gate+up splits", "splits qkv/o/down",
         "blocks/SM qkv/o/down/gate_up", "ms per step (median)", "spread", "max logit diff vs first"],
        [[r["stages"], r["carveouts"], r["warps_per_sm"], r["min_groups"], r["gate_up_splits"],
          "/".join(str(r["splits"][n]) for n in ("qkv", "o", "down")),
          "/".join(str(r["blocks_per_sm"][n]) for n in GEMVS), f"{r['ms_per_step']:.4f}",
          f"{max(r['runs_ms']) - min(r['runs_ms']):.4f}", f"{r['max_logit_diff']:.2e}"] for r in rows],
        args.json)
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
