"""Time candidate INT4 GEMV structures (tools/gemv_lab.cu) against the engine's, at the 7B's shapes.

For each (compile variant, launch geometry) it checks the result against a float64 reference on
random weights and activations, then times it as tools/bench_kernels.py does (a CUDA graph of
launches over >= 3x L2 of weight copies). `--profile` instead launches the main candidates a few
times eagerly, for ncu.

    PYTHONPATH=$PWD python3 tools/gemv_lab.py --json $OUT/gemv_lab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoqwen import cuda_build  # noqa: E402
from nanoqwen.backend_cuda import GEMV_THREADS, NULL, TILE_ROWS, gate_up_launch, gemv_splits  # noqa: E402
from nanoqwen.quant import dequantize_int4  # noqa: E402
from nanoqwen.random_model import QWEN25_CODER_7B  # noqa: E402
from tools.bench_kernels import copies_for, copy_bandwidth, median_launch_seconds, random_scales, random_words  # noqa: E402

# (depth, max threads, min blocks): registers per thread <= 65536 / (threads * min blocks)
COMPILE_VARIANTS = [(2, 256, 4)]
# (lite unpack?, ring stages) for the engine-shaped "lite" kernels
LITE_VARIANTS = [(0, 8)]
LITE_KERNELS = {"qkv": "lite_from_hidden", "o": "lite_from_q_dim", "down": "lite_from_intermediate",
                "gate_up": "lite_gate_up_silu"}
C = QWEN25_CODER_7B
H, I, Q, KV = C.hidden_size, C.intermediate_size, C.q_dim, C.kv_dim
# shape name -> (rows N, K, lab kernel, engine kernel, bias)
SHAPES = {
    "qkv": (Q + 2 * KV, H, "lab_from_hidden", "gemv_int4_from_hidden", True),
    "o": (H, Q, "lab_from_q_dim", "gemv_int4_from_q_dim", False),
    "down": (H, I, "lab_from_intermediate", "gemv_int4_from_intermediate", False),
    "gate_up": (I, H, "lab_gate_up_silu", "gemv_int4_gate_up_silu", False),
}
# launch geometries (slices = warps per block sharing a tile, splits = partial sums per row)
GEOMETRIES = {
    "qkv": [(2, 1), (4, 1), (7, 1), (4, 2), (7, 2)],
    "o": [(2, 1), (4, 1), (7, 1), (4, 2), (7, 2)],
    "down": [(4, 2), (8, 1), (8, 2), (4, 4), (16, 1), (8, 4)],
    "gate_up": [(1, 1), (2, 1), (4, 1), (7, 1)],
}


COAL_DEPTHS = (4,)
COALRING_STAGES = (4, 6, 8)
COAL_SPLITS = {"qkv": (1, 2), "o": (1, 2), "down": (1, 2, 4, 8), "gate_up": (1,)}
COAL_KERNELS = {"qkv": "coal_from_hidden", "o": "coal_from_q_dim", "down": "coal_from_intermediate",
                "gate_up": "coal_gate_up_silu"}


def time_coal(cp, module, problem, kernel, splits):
    function = module.get_function(kernel)
    n = problem.n
    if problem.fused:
        out = cp.full(n, np.nan, dtype=cp.float16)
        grid = -(-n // 4)

        def launch(i):
            function((grid,), (128,), (problem.qweights[i], problem.scales[i], problem.x, out))
    else:
        out = cp.full((splits, n), np.nan, dtype=cp.float32)
        grid = -(-((n + 1) // 2) * splits // 4)
        bias = NULL if problem.bias is None else problem.bias

        def launch(i):
            function((grid,), (128,), (problem.qweights[i], problem.scales[i], bias, problem.x, out, np.int32(n),
                                       np.int32(splits)))
    launch(0)
    cp.cuda.Device().synchronize()
    error = problem.error(out)
    return timed(cp, launch, problem.copies), error, function.num_regs


def compile_lab(cp, depth=2, threads=256, min_blocks=4, lite=1, stages=8, coal_depth=4, coalring_stages=5):
    defines = {"NQ_COAL_DEPTH": str(coal_depth), "NQ_COALRING_STAGES": str(coalring_stages), **cuda_build.kernel_defines(C), "NQ_LAB_DEPTH": str(depth), "NQ_LAB_MAX_THREADS": str(threads),
               "NQ_LAB_MIN_BLOCKS": str(min_blocks), "NQ_LAB_LITE": str(lite), "NQ_GEMV_STAGES": str(stages),
               "NQ_SOURCES_HASH": "0x" + cuda_build.sources_hash()}
    source = (REPO / "tools" / "gemv_lab.cu").read_text()
    options = ("-std=c++17", f"-I{cuda_build.kernel_dir()}", *cuda_build.define_options(defines))
    module = cp.RawModule(code=source, options=options)
    module.compile()
    return module


class Problem:
    """Random weights (copies rotate past L2), activations and a float64 reference of some rows."""

    def __init__(self, cp, shape, l2_bytes, rng):
        n, k, _, _, bias = SHAPES[shape]
        self.fused = shape == "gate_up"
        rows = 2 * n if self.fused else n
        self.n, self.k, self.rows = n, k, rows
        self.weight_bytes = rows * k // 2 + rows * (k // 128) * 2
        self.copies = copies_for(self.weight_bytes, l2_bytes)
        self.qweights = [random_words(cp, (rows, k // 8)) for _ in range(self.copies)]
        self.scales = [random_scales(cp, (rows, k // 128)) for _ in range(self.copies)]
        self.x = cp.asarray(rng.standard_normal(k).astype(np.float16))
        self.bias = cp.asarray((0.1 * rng.standard_normal(n)).astype(np.float16)) if bias else None
        check = np.unique(np.concatenate([rng.integers(0, n, 48), [0, n - 1, 15, 16]]))
        weight_rows = np.concatenate([check, check + n]) if self.fused else check
        w = dequantize_int4(self.qweights[0][weight_rows].get(), self.scales[0][weight_rows].get()).astype(np.float64)
        y = w @ self.x.get().astype(np.float64)
        if self.fused:
            gate, up = y[: len(check)], y[len(check):]
            y = gate / (1 + np.exp(-gate)) * up
        elif self.bias is not None:
            y += self.bias.get()[check].astype(np.float64)
        self.check, self.expected = check, y
        self.scale = np.abs(w).sum(axis=1)[: len(check)] * np.abs(self.x.get()).max()

    def error(self, out) -> float:
        got = out.get().astype(np.float64)
        got = got[self.check] if self.fused else got.sum(axis=0)[self.check]
        if not np.isfinite(got).all():
            return float("inf")
        tolerance = (2e-3 * np.abs(self.expected)) if self.fused else (1e-5 * self.scale + 1e-5)
        return float((np.abs(got - self.expected) / (tolerance + 1e-6)).max())  # <= 1 passes


def timed(cp, launch, copies) -> float:
    return 0.0 if PROFILING else median_launch_seconds(cp, launch, copies)


PROFILING = False


def time_lab(cp, module, problem, kernel, slices, splits):
    function = module.get_function(kernel)
    n = problem.n
    if problem.fused:
        out = cp.full(n, np.nan, dtype=cp.float16)
        grid, block = -(-n // TILE_ROWS), 2 * slices * 32

        def launch(i):
            function((grid,), (block,), (problem.qweights[i], problem.scales[i], problem.x, out))
    else:
        out = cp.full((splits, n), np.nan, dtype=cp.float32)
        grid, block = -(-n // TILE_ROWS) * splits, slices * 32
        bias = NULL if problem.bias is None else problem.bias

        def launch(i):
            function((grid,), (block,), (problem.qweights[i], problem.scales[i], bias, problem.x, out, np.int32(n),
                                         np.int32(splits)))
    launch(0)
    cp.cuda.Device().synchronize()
    error = problem.error(out)
    return timed(cp, launch, problem.copies), error, function.num_regs


def time_engine(cp, module, problem, kernel, num_sms, warps_per_sm=None):
    """An engine-shaped kernel (16-row tiles, one warp per block) at the engine's launch geometry,
    or with the split-K target `warps_per_sm` instead of the engine's."""
    function = module.get_function(kernel)
    n = problem.n
    if problem.fused:
        out = cp.full(n, np.nan, dtype=cp.float16)
        grid, block = gate_up_launch(n)

        def launch(i):
            function(grid, block, (problem.qweights[i], problem.scales[i], problem.x, out))
        splits = 1
    else:
        splits = gemv_splits(n, problem.k, num_sms, **({} if warps_per_sm is None else {"warps_per_sm": warps_per_sm}))
        out = cp.full((splits, n), np.nan, dtype=cp.float32)
        bias = NULL if problem.bias is None else problem.bias

        def launch(i):
            function((-(-n // TILE_ROWS) * splits,), (GEMV_THREADS,), (problem.qweights[i], problem.scales[i], bias,
                                                                       problem.x, out, np.int32(n), np.int32(splits)))
    launch(0)
    cp.cuda.Device().synchronize()
    error = problem.error(out)
    return timed(cp, launch, problem.copies), error, splits, function.num_regs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true", help="eager launches of the main candidates, for ncu")
    parser.add_argument("--ab", action="store_true", help="only the engine's gate+up against the coal form")
    args = parser.parse_args(argv)
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(0)
    l2_bytes, num_sms = props["l2CacheSize"], props["multiProcessorCount"]
    rng = np.random.default_rng(7)
    engine = cuda_build.compile_module(C)
    problems = {shape: Problem(cp, shape, l2_bytes, rng) for shape in SHAPES}
    if args.profile:
        global PROFILING
        PROFILING = True
        lite = compile_lab(cp, lite=1, stages=8, coalring_stages=8)
        for shape, (n, k, lab_kernel, engine_kernel, _) in SHAPES.items():
            for _ in range(2):
                time_engine(cp, engine, problems[shape], engine_kernel, num_sms)
                time_engine(cp, lite, problems[shape], LITE_KERNELS[shape], num_sms)
                time_coal(cp, lite, problems[shape], COAL_KERNELS[shape].replace("coal_", "coalring_"), COAL_SPLITS[shape][-1])
        return
    copy = copy_bandwidth(cp)
    rows = []
    for shape, (n, k, lab_kernel, engine_kernel, _) in ({} if args.ab else SHAPES).items():
        problem = problems[shape]
        seconds, error, splits, regs = time_engine(cp, engine, problem, engine_kernel, num_sms)
        rows.append(dict(shape=shape, variant="engine", geometry=f"split {splits}", regs=regs, us=seconds * 1e6,
                         error=error, bytes=problem.weight_bytes))
    for depth, threads, min_blocks in ([] if args.ab else COMPILE_VARIANTS):
        module = compile_lab(cp, depth, threads, min_blocks)
        for shape, (n, k, lab_kernel, engine_kernel, _) in SHAPES.items():
            for slices, splits in GEOMETRIES[shape]:
                if (2 if shape == "gate_up" else 1) * slices * 32 > threads:
                    continue
                seconds, error, regs = time_lab(cp, module, problems[shape], lab_kernel, slices, splits)
                rows.append(dict(shape=shape, variant=f"reg d{depth} t{threads} b{min_blocks}",
                                 geometry=f"slices {slices} split {splits}", regs=regs, us=seconds * 1e6,
                                 error=error, bytes=problems[shape].weight_bytes))
    for lite_unpack, stages in ([] if args.ab else LITE_VARIANTS):
        module = compile_lab(cp, lite=lite_unpack, stages=stages)
        for shape in SHAPES:
            for warps_per_sm in (12, 20) if shape != "gate_up" else (None,):
                problem = problems[shape]
                function = LITE_KERNELS[shape]
                seconds, error, splits, regs = time_engine(cp, module, problem, function, num_sms, warps_per_sm)
                rows.append(dict(shape=shape, variant=f"{'lite' if lite_unpack else 'two-acc'} ring {stages}",
                                 geometry=f"split {splits}", regs=regs, us=seconds * 1e6, error=error,
                                 bytes=problem.weight_bytes))
    for coal_depth in ([] if args.ab else COAL_DEPTHS):
        module = compile_lab(cp, coal_depth=coal_depth)
        for shape in SHAPES:
            for splits in COAL_SPLITS[shape]:
                seconds, error, regs = time_coal(cp, module, problems[shape], COAL_KERNELS[shape], splits)
                rows.append(dict(shape=shape, variant=f"coal depth {coal_depth}", geometry=f"split {splits}", regs=regs,
                                 us=seconds * 1e6, error=error, bytes=problems[shape].weight_bytes))
    for ring_stages in ([] if args.ab else COALRING_STAGES):
        module = compile_lab(cp, coalring_stages=ring_stages)
        for shape in SHAPES:
            for splits in COAL_SPLITS[shape]:
                kernel = COAL_KERNELS[shape].replace("coal_", "coalring_")
                seconds, error, regs = time_coal(cp, module, problems[shape], kernel, splits)
                rows.append(dict(shape=shape, variant=f"coalring {ring_stages}", geometry=f"split {splits}", regs=regs,
                                 us=seconds * 1e6, error=error, bytes=problems[shape].weight_bytes))
    module = compile_lab(cp)
    for _ in range(2):  # the engine's gate+up against the coal form, alternated in one run
        problem = problems["gate_up"]
        seconds, error, _, regs = time_engine(cp, engine, problem, "gemv_int4_gate_up_silu", num_sms)
        rows.append(dict(shape="gate_up", variant="engine (16-row tiles)", geometry="split 1", regs=regs,
                         us=seconds * 1e6, error=error, bytes=problem.weight_bytes))
        seconds, error, regs = time_coal(cp, module, problem, "coal_gate_up_silu", 1)
        rows.append(dict(shape="gate_up", variant="coal depth 4", geometry="split 1", regs=regs,
                         us=seconds * 1e6, error=error, bytes=problem.weight_bytes))
    for r in rows:
        r["of_copy"] = r["bytes"] / (r["us"] * 1e-6) / copy
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s (read + write)")
    print("| shape | variant | geometry | regs | us | of copy | error/tol |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in sorted(rows, key=lambda r: (r["shape"], r["us"])):
        print(f"| {r['shape']} | {r['variant']} | {r['geometry']} | {r['regs']} | {r['us']:.1f} | {r['of_copy']:.0%} "
              f"| {r['error']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(dict(copy_bytes_per_s=copy, rows=rows), indent=1))


if __name__ == "__main__":
    main()
