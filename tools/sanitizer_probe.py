"""Which global -> shared copy mechanisms does compute-sanitizer's racecheck accept in a
warp-specialized producer/consumer ring? A probe for issue #5, run on the H200.

    export PYTHONUNBUFFERED=1
    PYTHONPATH=$PWD python3 tools/sanitizer_probe.py --out "$OUT"     # ~60 s on an H200
    PYTHONPATH=$PWD python3 tools/sanitizer_probe.py --out "$OUT" --only bulk,bulk_named_empty,bulk_named_empty_broken
    python3 tools/sanitizer_probe.py --dry-run                         # no GPU: sources, nvcc, map arguments

tools/sanitizer_probe.cu holds one small kernel per mechanism, all with the decode kernel's
hand-off shape (a producer warp filling a 4-stage ring of 4 KiB slices, `full`/`empty`
mbarriers, consumer warps summing slices out of shared memory), and `_broken` twins whose
consumers read without waiting on `full` (`_decode_broken`: with paged_attention_broken.cu's
hooks exactly). A second group keeps the bulk copy and changes the hand-off: every consumer
lane arriving on `empty` itself, or hardware named barriers (bar.arrive / bar.sync) for `empty`
or for both directions; their broken twins skip the consumers' wait in each stage's first round.

Each variant runs in its own subprocess (this script again, with --variant NAME, bounded by a
30 s timeout): natively, under `compute-sanitizer --tool racecheck` and under `--tool
synccheck`. Every run checks its sums against numpy. Variants with racecheck hazards are run
once more with `--racecheck-report hazard` to say which accesses racecheck paired (RAW / WAR,
by which threads, and which lanes of the reading warps), and a few variants run with
`--racecheck-trace-sync yes` to show which synchronization operations racecheck saw at all.
`--only` runs a subset (the verdict of a mechanism needs its fixed kernel and all its twins).

A mechanism answers issue #5 if its fixed kernel is correct, racecheck-clean and synccheck-clean
AND its broken twin is reported by racecheck. Logs, summary.json and summary.md go to
--out/sanitizer_probe/; the table is printed last.

Tensor maps are encoded with the driver's cuTensorMapEncodeTiled through ctypes into a 64-byte
aligned buffer (the alignment the driver asks for); a side check reports whether
cuda.bindings.driver.cuTensorMapEncodeTiled produces the same 128 bytes on that machine.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import ctypes
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SOURCE = Path(__file__).with_suffix(".cu")

# Mirrors of tools/sanitizer_probe.cu's constants (the kernels check the launch against them).
STAGES = 4
SLICE_ROWS, ROW_WORDS = 16, 64
SLICE_WORDS = SLICE_ROWS * ROW_WORDS
TMA1D_BOX = 256
BLOCKS = 2
SLICES_PER_BLOCK = 3 * STAGES + 1  # every stage reused twice, and an odd tail
POOL_SLICES = 40
TIMEOUT_S = 30
RESULT_TAG = "PROBE_RESULT "

# CUtensorMap enums (cuda.h; --dry-run cross-checks them against cuda.bindings when present).
TENSOR_MAP_INT32 = 3
TENSOR_MAP_INTERLEAVE_NONE = 0
TENSOR_MAP_SWIZZLE_NONE = 0
TENSOR_MAP_L2_PROMOTION_128B = 2
TENSOR_MAP_OOB_FILL_NONE = 0


@dataclasses.dataclass(frozen=True)
class Variant:
    kernel: str
    mechanism: str
    waits: bool        # False: the consumers read without waiting on `full` (a real race, on purpose)
    module: str        # "core" (raw PTX) or "libcu" (libcu++, compiled with -DPROBE_LIBCUDACXX)
    source: str        # "pool": the pool pointer; "map1d"/"map3d": a tensor map
    launch: str        # "cupy": RawKernel call; "driver": cuLaunchKernel with a 128-byte parameter


VARIANTS = {
    "bulk": Variant("probe_bulk", "cp.async.bulk, arrive.expect_tx then copy (decode kernel today)", True, "core", "pool", "cupy"),
    "bulk_broken": Variant("probe_bulk_broken", "bulk, consumers neither wait nor release", False, "core", "pool", "cupy"),
    "bulk_decode_broken": Variant("probe_bulk_decode_broken", "bulk, paged_attention_broken.cu's hooks", False, "core", "pool", "cupy"),
    "bulk_copy_first": Variant("probe_bulk_copy_first", "cp.async.bulk, copy then arrive.expect_tx", True, "core", "pool", "cupy"),
    "bulk_split": Variant("probe_bulk_split", "cp.async.bulk, expect_tx; copy; plain arrive", True, "core", "pool", "cupy"),
    "bulk_split_broken": Variant("probe_bulk_split_broken", "bulk_split, consumers neither wait nor release", False, "core", "pool", "cupy"),
    "bulk_split_decode_broken": Variant("probe_bulk_split_decode_broken", "bulk_split, paged_attention_broken.cu's hooks", False, "core", "pool", "cupy"),
    "tma1d_global": Variant("probe_tma1d_global", "cp.async.bulk.tensor.1d, map in global memory", True, "core", "map1d", "cupy"),
    "tma3d_global": Variant("probe_tma3d_global", "cp.async.bulk.tensor.3d, map in global memory", True, "core", "map3d", "cupy"),
    "tma3d_global_broken": Variant("probe_tma3d_global_broken", "tma3d_global, consumers neither wait nor release", False, "core", "map3d", "cupy"),
    "tma3d_global_decode_broken": Variant("probe_tma3d_global_decode_broken", "tma3d_global, paged_attention_broken.cu's hooks", False, "core", "map3d", "cupy"),
    "tma3d_param": Variant("probe_tma3d_param", "cp.async.bulk.tensor.3d, __grid_constant__ map", True, "core", "map3d", "driver"),
    "memcpy_async": Variant("probe_memcpy_async", "cuda::memcpy_async + cuda::barrier (libcu++)", True, "libcu", "pool", "cupy"),
    "memcpy_async_broken": Variant("probe_memcpy_async_broken", "memcpy_async, consumers neither wait nor release", False, "libcu", "pool", "cupy"),
    "cpasync": Variant("probe_cpasync", "32 lanes x cp.async 16 B + cp.async.mbarrier.arrive.noinc", True, "core", "pool", "cupy"),
    "cpasync_broken": Variant("probe_cpasync_broken", "cpasync, consumers neither wait nor release", False, "core", "pool", "cupy"),
    "plain": Variant("probe_plain", "32 lanes ld.global/st.shared + mbarrier.arrive (control)", True, "core", "pool", "cupy"),
    "plain_broken": Variant("probe_plain_broken", "plain, consumers neither wait nor release", False, "core", "pool", "cupy"),
    "bulk_lane_empty": Variant("probe_bulk_lane_empty", "bulk; every consumer lane arrives on `empty` (32 arrivals)", True, "core", "pool", "cupy"),
    "bulk_lane_empty_broken": Variant("probe_bulk_lane_empty_broken", "bulk_lane_empty, first round read unwaited", False, "core", "pool", "cupy"),
    "bulk_named_empty": Variant("probe_bulk_named_empty", "bulk; `empty` = named barrier (bar.arrive / bar.sync)", True, "core", "pool", "cupy"),
    "bulk_named_empty_broken": Variant("probe_bulk_named_empty_broken", "bulk_named_empty, first round read unwaited", False, "core", "pool", "cupy"),
    "bulk_named_both": Variant("probe_bulk_named_both", "bulk; `full` and `empty` = named barriers", True, "core", "pool", "cupy"),
    "bulk_named_both_broken": Variant("probe_bulk_named_both_broken", "bulk_named_both, first round read unwaited", False, "core", "pool", "cupy"),
}
# A mechanism answers issue #5 when its fixed kernel is clean and every broken twin is reported.
PAIRS = {
    "bulk (as now)": ("bulk", ("bulk_broken", "bulk_decode_broken")),
    "bulk, split arrive": ("bulk_split", ("bulk_split_broken", "bulk_split_decode_broken")),
    "tensor map (TMA)": ("tma3d_global", ("tma3d_global_broken", "tma3d_global_decode_broken")),
    "cuda::memcpy_async": ("memcpy_async", ("memcpy_async_broken",)),
    "cp.async + noinc": ("cpasync", ("cpasync_broken",)),
    "plain copy (control)": ("plain", ("plain_broken",)),
    # paged_attention_broken.cu replaces both directions' hooks, so its twin is bulk_decode_broken.
    "bulk, lane arrivals": ("bulk_lane_empty", ("bulk_lane_empty_broken", "bulk_decode_broken")),
    "bulk, named empty": ("bulk_named_empty", ("bulk_named_empty_broken", "bulk_decode_broken")),
    "bulk, named both": ("bulk_named_both", ("bulk_named_both_broken", "bulk_decode_broken")),
}
TRACED = ("bulk", "bulk_split", "bulk_lane_empty", "bulk_named_empty")
HAZARD_PRINT_LIMIT = 500  # the hazard-detail runs print this many: enough to see which lanes read


def log(*parts) -> None:
    print(*parts, flush=True)


# ---------------------------------------------------------------------- inputs and tensor maps


def make_inputs(seed: int = 5):
    """Pool int32 [POOL_SLICES, 16, 64] of random values in [1, 1000), a table naming
    BLOCKS x SLICES_PER_BLOCK distinct slices, and the sum of each named slice."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(1, 1000, size=(POOL_SLICES, SLICE_ROWS, ROW_WORDS), dtype=np.int32)
    table = rng.permutation(POOL_SLICES)[: BLOCKS * SLICES_PER_BLOCK].astype(np.int32)
    expected = pool[table].reshape(len(table), -1).sum(axis=1, dtype=np.int64)
    return pool, table, expected


def tensor_map_arguments(kind: str, pool_slices: int = POOL_SLICES) -> dict:
    """cuTensorMapEncodeTiled's arguments for the pool, innermost dimension first.

    map3d: dims (64 words, 16 rows, slices), one box = one whole 4 KiB slice at (0, 0, slice).
    map1d: the pool as one run of words, boxes of 256 words (a box has at most 256 per dim).
    """
    if kind == "map3d":
        dims = [ROW_WORDS, SLICE_ROWS, pool_slices]
        strides = [ROW_WORDS * 4, SLICE_WORDS * 4]  # bytes, for dims 1..rank-1
        box = [ROW_WORDS, SLICE_ROWS, 1]
    elif kind == "map1d":
        dims, strides, box = [pool_slices * SLICE_WORDS], [], [TMA1D_BOX]
    else:
        raise ValueError(f"unknown tensor map kind {kind!r}")
    return dict(data_type=TENSOR_MAP_INT32, rank=len(dims), dims=dims, strides=strides, box=box,
                element_strides=[1] * len(dims), interleave=TENSOR_MAP_INTERLEAVE_NONE,
                swizzle=TENSOR_MAP_SWIZZLE_NONE, l2_promotion=TENSOR_MAP_L2_PROMOTION_128B,
                oob_fill=TENSOR_MAP_OOB_FILL_NONE)


def check_tensor_map_arguments(args: dict) -> None:
    """The driver's documented limits, so a bad map fails here with a reason, not as a CUDA error."""
    if not 1 <= args["rank"] <= 5:
        raise ValueError(f"tensor rank {args['rank']} not in 1..5")
    for stride in args["strides"]:
        if stride % 16 or stride >= 2**40:
            raise ValueError(f"global stride {stride} must be a multiple of 16 below 2^40")
    for size in args["box"]:
        if not 0 < size <= 256:
            raise ValueError(f"box size {size} not in 1..256")
    if args["box"][0] * 4 % 16:
        raise ValueError("the box's inner dimension must span a multiple of 16 bytes")


def aligned_bytes(size: int, alignment: int) -> np.ndarray:
    """A zeroed uint8 view of `size` bytes whose address is a multiple of `alignment`."""
    raw = np.zeros(size + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    view = raw[start : start + size]
    assert view.ctypes.data % alignment == 0
    return view


def libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
    lib.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernel.restype = ctypes.c_int
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    return lib


def encode_tensor_map(kind: str, pool_address: int) -> np.ndarray:
    """The 128-byte CUtensorMap for the pool at `pool_address`, in a 64-byte aligned buffer."""
    args = tensor_map_arguments(kind)
    check_tensor_map_arguments(args)
    tensor_map = aligned_bytes(128, 64)
    u64 = lambda values: np.array(values, dtype=np.uint64) if values else np.zeros(1, np.uint64)  # noqa: E731
    dims, strides = u64(args["dims"]), u64(args["strides"])
    box = np.array(args["box"], dtype=np.uint32)
    element_strides = np.array(args["element_strides"], dtype=np.uint32)
    status = libcuda().cuTensorMapEncodeTiled(
        tensor_map.ctypes.data, args["data_type"], args["rank"], pool_address, dims.ctypes.data,
        strides.ctypes.data, box.ctypes.data, element_strides.ctypes.data, args["interleave"],
        args["swizzle"], args["l2_promotion"], args["oob_fill"])
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled({kind}) failed with CUresult {status}")
    return tensor_map


def encode_with_bindings(kind: str, pool_address: int) -> bytes:
    """The same map through cuda.bindings.driver (checked against the ctypes encoding)."""
    from cuda.bindings import driver

    args = tensor_map_arguments(kind)
    status, tensor_map = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType(args["data_type"]), args["rank"], pool_address,
        [driver.cuuint64_t(v) for v in args["dims"]], [driver.cuuint64_t(v) for v in args["strides"]],
        [driver.cuuint32_t(v) for v in args["box"]], [driver.cuuint32_t(v) for v in args["element_strides"]],
        driver.CUtensorMapInterleave(args["interleave"]), driver.CUtensorMapSwizzle(args["swizzle"]),
        driver.CUtensorMapL2promotion(args["l2_promotion"]), driver.CUtensorMapFloatOOBfill(args["oob_fill"]))
    if status != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuda.bindings cuTensorMapEncodeTiled({kind}) returned {status}")
    return ctypes.string_at(tensor_map.getPtr(), 128)


# ---------------------------------------------------------------------- build and launch (GPU side)


def compile_options(module: str) -> tuple[str, ...]:
    options = ("-std=c++17", "-lineinfo", f"-I{REPO / 'kernels'}")  # mbarrier.cuh, shared with the engine
    return options + (("-DPROBE_LIBCUDACXX",) if module == "libcu" else ())


def build_module(cp, module: str):
    return cp.RawModule(code=SOURCE.read_text(), options=compile_options(module))


def device_int(cp, module, name: str) -> int:
    return int(cp.ndarray((1,), cp.int32, memptr=module.get_global(name)).get()[0])


def run_variant(name: str, launch_override: str | None) -> dict:
    """Build, launch once, compare with numpy; returns the result record (also printed)."""
    import cupy as cp

    variant = VARIANTS[name]
    module = build_module(cp, variant.module)
    kernel = module.get_function(variant.kernel)
    threads = device_int(cp, module, "probe_threads")
    smem = device_int(cp, module, "probe_smem_bytes")
    if device_int(cp, module, "probe_slice_words") != SLICE_WORDS:
        raise RuntimeError("tools/sanitizer_probe.cu and .py disagree on the slice size")
    pool_h, table_h, expected = make_inputs()
    pool, table = cp.asarray(pool_h), cp.asarray(table_h)
    out = cp.full(len(table_h), -1, dtype=cp.int32)  # poison: a sum of positive numbers is never -1
    n = np.int32(SLICES_PER_BLOCK)
    launch = launch_override or variant.launch
    record = dict(variant=name, launch=launch)

    if variant.source == "pool":
        kernel((BLOCKS,), (threads,), (pool, table, n, out), shared_mem=smem)
    else:
        tensor_map = encode_tensor_map(variant.source, pool.data.ptr)
        if launch == "cupy":
            map_device = cp.asarray(tensor_map)  # CuPy allocations are 256-byte aligned
            kernel((BLOCKS,), (threads,), (map_device, table, n, out), shared_mem=smem)
        elif launch == "cupy-void":
            # Can CuPy's argument packing carry the 128-byte map as a numpy scalar?
            kernel((BLOCKS,), (threads,), (np.void(tensor_map.tobytes()), table, n, out), shared_mem=smem)
        elif launch == "driver":
            # cuLaunchKernel's kernelParams: one pointer per parameter, to that parameter's bytes.
            table_pointer = np.array([table.data.ptr], dtype=np.uint64)
            out_pointer = np.array([out.data.ptr], dtype=np.uint64)
            n_value = np.array([n], dtype=np.int32)
            params = np.array([a.ctypes.data for a in (tensor_map, table_pointer, n_value, out_pointer)], dtype=np.uint64)
            stream = cp.cuda.get_current_stream().ptr
            status = libcuda().cuLaunchKernel(kernel.kernel.ptr, BLOCKS, 1, 1, threads, 1, 1, smem, stream,
                                              params.ctypes.data, None)
            if status != 0:
                raise RuntimeError(f"cuLaunchKernel failed with CUresult {status}")
        else:
            raise ValueError(f"unknown launch {launch!r}")
    cp.cuda.get_current_stream().synchronize()
    got = out.get()
    wrong = int(np.count_nonzero(got != expected))
    record.update(correct=wrong == 0, wrong_slices=wrong, slices=len(expected))
    log(RESULT_TAG + json.dumps(record))
    return record


def warm(names: list[str]) -> None:
    """Compile the modules these variants need once (filling CuPy's kernel cache for the
    parallel runs) and print the versions the results depend on."""
    import cupy as cp

    began = time.time()
    info = dict(cupy=cp.__version__, nvrtc=".".join(map(str, cp.cuda.nvrtc.getVersion())),
                driver=cp.cuda.runtime.driverGetVersion(), runtime=cp.cuda.runtime.runtimeGetVersion(),
                gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for module in sorted({VARIANTS[n].module for n in names}):
        try:
            build_module(cp, module).get_function(next(v.kernel for v in VARIANTS.values() if v.module == module))
            info[f"compile_{module}"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded: the other module's variants still run
            info[f"compile_{module}"] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log(f"compile {module} failed:\n{e}")
    info["compile_s"] = round(time.time() - began, 1)
    log(RESULT_TAG + json.dumps(info))


def check_bindings_encoder(_args) -> None:
    """Does cuda.bindings.driver.cuTensorMapEncodeTiled give the ctypes encoder's bytes?"""
    import cupy as cp

    pool = cp.zeros((POOL_SLICES, SLICE_ROWS, ROW_WORDS), dtype=cp.int32)
    record = {}
    try:
        import cuda.bindings

        record["cuda_bindings"] = getattr(cuda.bindings, "__version__", "?")
        for kind in ("map1d", "map3d"):
            record[kind] = "same bytes" if encode_with_bindings(kind, pool.data.ptr) == encode_tensor_map(
                kind, pool.data.ptr).tobytes() else "DIFFERENT bytes"
    except Exception as e:  # noqa: BLE001 - the answer is the exception
        record["error"] = f"{type(e).__name__}: {e}"
    log(RESULT_TAG + json.dumps(record))


# ---------------------------------------------------------------------- parsing sanitizer output

RACECHECK_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
# "Potential RAW hazard detected (CUDA barrier operation) at __shared__ 0x40 in block (1,0,0) :"
HAZARD = re.compile(r"Potential (\w+) hazard detected(?: \(([^)]*)\))? at __shared__ (0x[0-9a-f]+) in block")
ACCESS = re.compile(r"(Read|Write) Thread \(([\d,]+)\)")


def parse_result(text: str) -> dict | None:
    records = [json.loads(line.split(RESULT_TAG, 1)[1]) for line in text.splitlines() if RESULT_TAG in line]
    return records[-1] if records else None


def parse_racecheck(text: str) -> dict | None:
    found = RACECHECK_SUMMARY.findall(text)
    if not found:
        return None
    hazards, errors, warnings = map(int, found[-1])
    return dict(hazards=hazards, errors=errors, warnings=warnings)


def parse_error_summary(text: str) -> int | None:
    found = ERROR_SUMMARY.findall(text)
    return int(found[-1]) if found else None


def parse_hazard_kinds(text: str) -> dict:
    """Counts of RAW/WAR/WAW hazards and, per kind, the (first access, second access) thread
    pairs seen and the lanes (x % 32) of the reading threads, from `--racecheck-report hazard`
    output. The lanes tell a release that racecheck does not follow at all (every lane of the
    consumer warp, lane 0 too) from one it follows only from the arriving lane (lanes 1-31:
    the __syncwarp() before lane 0's arrival is not an edge for it)."""
    kinds = collections.Counter()
    pairs = collections.defaultdict(set)
    reader_lanes = collections.defaultdict(set)
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = HAZARD.search(line)
        if not m:
            continue
        kind = m.group(1) + (f" ({m.group(2)})" if m.group(2) else "")
        kinds[kind] += 1
        accesses = [ACCESS.search(x) for x in lines[i + 1 : i + 3]]
        if all(accesses):
            pairs[kind].add(" -> ".join(f"{a.group(1)} t({a.group(2)})" for a in accesses))
            reader_lanes[kind].update(int(a.group(2).split(",")[0]) % 32 for a in accesses if a.group(1) == "Read")
    return dict(kinds=dict(kinds), pairs={k: sorted(v)[:4] for k, v in pairs.items()},
                reader_lanes={k: lane_ranges(v) for k, v in reader_lanes.items()})


def lane_ranges(lanes) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    runs = []
    for lane in sorted(lanes):
        if runs and lane == runs[-1][1] + 1:
            runs[-1][1] = lane
        else:
            runs.append([lane, lane])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_trace(text: str) -> dict:
    """Which synchronization operations --racecheck-trace-sync logged, by their leading words."""
    counts = collections.Counter()
    for line in text.splitlines():
        body = line.removeprefix("=========").strip()
        if " called by threads" in body:
            counts[body.split(" called by threads")[0]] += 1
    return dict(counts)


# ---------------------------------------------------------------------- running the jobs


@dataclasses.dataclass
class Job:
    name: str        # log file stem
    variant: str
    tool: str        # native | racecheck | synccheck
    flags: tuple = ()
    launch: str | None = None
    mode: str = "variant"  # variant | warm | bindings
    print_limit: int = 20
    warm_variants: tuple = ()  # mode "warm": the variants whose modules to compile


def job_command(job: Job, sanitizer: str | None) -> list[str]:
    me = [sys.executable, str(Path(__file__).resolve())]
    if job.mode == "warm":
        return me + ["--warm", ",".join(job.warm_variants)]
    if job.mode == "bindings":
        return me + ["--check-bindings-encoder"]
    command = me + ["--variant", job.variant] + (["--launch", job.launch] if job.launch else [])
    if job.tool == "native":
        return command
    return [sanitizer, "--tool", job.tool, "--print-limit", str(job.print_limit), *job.flags] + command


def run_job(job: Job, sanitizer: str | None, folder: Path) -> dict:
    logfile = folder / f"{job.name}.log"
    command = job_command(job, sanitizer)
    began = time.time()
    with logfile.open("w") as sink:
        sink.write("$ " + " ".join(command) + "\n")
        sink.flush()
        # A session of its own, so a timeout can end the sanitizer and the process it started.
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            status = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timeout"
    text = logfile.read_text(errors="replace")
    return dict(job=job.name, variant=job.variant, tool=job.tool, status=status, seconds=round(time.time() - began, 1),
                result=parse_result(text), racecheck=parse_racecheck(text), errors=parse_error_summary(text),
                hazard_kinds=parse_hazard_kinds(text) if "--racecheck-report" in job.flags else None,
                trace=parse_trace(text) if "--racecheck-trace-sync" in job.flags else None, log=logfile.name)


def run_all(jobs: list[Job], sanitizer: str | None, folder: Path, workers: int) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_job, job, sanitizer, folder) for job in jobs]
        rows = []
        for future in concurrent.futures.as_completed(futures):
            row = future.result()
            rows.append(row)
            summary = row["racecheck"] or (f"errors {row['errors']}" if row["errors"] is not None else "")
            log(f"  {row['job']:<44} exit {row['status']!s:<8} {row['seconds']:>5.1f} s  "
                f"{'correct' if (row['result'] or {}).get('correct') else 'WRONG/none'}  {summary}")
    return sorted(rows, key=lambda r: r["job"])


def sanitizer_version(sanitizer: str) -> str:
    try:
        text = subprocess.run([sanitizer, "--version"], capture_output=True, text=True, timeout=TIMEOUT_S).stdout
        return " ".join(line.strip() for line in text.splitlines() if "Version" in line or "version" in line) or text.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"


def table_rows(rows: list[dict]) -> list[dict]:
    """One line per variant: native correctness, racecheck summary, synccheck errors, notes."""
    by = {(r["variant"], r["job"].split(".", 1)[1]): r for r in rows if "." in r["job"]}
    lines = []
    for name, variant in VARIANTS.items():
        if not any(r["variant"] == name for r in rows):
            continue
        native, race, sync = by.get((name, "native")), by.get((name, "racecheck")), by.get((name, "synccheck"))
        detail = by.get((name, "racecheck-hazard"))
        trace = by.get((name, "racecheck-trace"))

        def correct(row):
            if row is None:
                return "-"
            result = row["result"]
            if result is None:
                return f"no result (exit {row['status']})"
            return "yes" if result["correct"] else f"NO ({result['wrong_slices']}/{result['slices']} wrong)"

        race_text = "-" if race is None else (
            f"{race['racecheck']['hazards']} ({race['racecheck']['errors']} err, {race['racecheck']['warnings']} warn)"
            if race["racecheck"] else f"no summary (exit {race['status']})")
        sync_text = "-" if sync is None else (str(sync["errors"]) if sync["errors"] is not None else f"no summary (exit {sync['status']})")
        notes = []
        if detail and detail["hazard_kinds"]:
            kinds = detail["hazard_kinds"]
            notes.append(", ".join(f"{k} x{v}" for k, v in kinds["kinds"].items()))
            notes += [p for ps in kinds["pairs"].values() for p in ps[:2]]
            notes += [f"{k} reading lanes {v}" for k, v in kinds["reader_lanes"].items()]
        if trace and trace["trace"] is not None:
            notes.append("traced: " + (", ".join(f"{k} x{v}" for k, v in trace["trace"].items()) or "nothing"))
        lines.append(dict(variant=name, mechanism=variant.mechanism, waits=variant.waits,
                          native=correct(native), under_racecheck=correct(race), racecheck=race_text,
                          racecheck_hazards=race["racecheck"]["hazards"] if race and race["racecheck"] else None,
                          synccheck=sync_text, notes="; ".join(notes)))
    return lines


def verdicts(lines: list[dict]) -> list[str]:
    by = {line["variant"]: line for line in lines}
    out = []
    for label, (fixed, brokens) in PAIRS.items():
        missing = [n for n in (fixed, *brokens) if n not in by]
        if fixed in by and missing:
            out.append(f"{label:<22} not judged: the run lacks {', '.join(missing)}")
        if missing:
            continue
        f = by[fixed]
        fixed_clean = f["native"] == "yes" and f["racecheck_hazards"] == 0 and f["synccheck"] == "0"
        broken_seen = all(isinstance(by[b]["racecheck_hazards"], int) and by[b]["racecheck_hazards"] > 0 for b in brokens)
        answer = "ANSWERS #5" if fixed_clean and broken_seen else "no"
        out.append(f"{label:<22} fixed clean: {'yes' if fixed_clean else 'no':<4} broken reported: "
                   f"{'yes' if broken_seen else 'no':<4} -> {answer}")
    return out


def write_reports(folder: Path, header: dict, rows: list[dict], lines: list[dict]) -> str:
    columns = ("variant", "native", "under_racecheck", "racecheck", "synccheck", "notes")
    md = ["# compute-sanitizer probe (tools/sanitizer_probe.py)", ""]
    md += [f"- {k}: {v}" for k, v in header.items()] + [""]
    md += ["| variant | mechanism | result correct (native) | correct under racecheck | racecheck hazards | "
           "synccheck errors | notes |", "| --- | --- | --- | --- | --- | --- | --- |"]
    md += [f"| {l['variant']} | {l['mechanism']} | {l['native']} | {l['under_racecheck']} | {l['racecheck']} | "
           f"{l['synccheck']} | {l['notes']} |" for l in lines]
    md += ["", "```text", *verdicts(lines), "```", ""]
    (folder / "summary.md").write_text("\n".join(md))
    (folder / "summary.json").write_text(json.dumps(dict(header=header, rows=rows, table=lines), indent=1))
    widths = {c: max(len(c), *(len(str(l[c])) for l in lines)) for c in columns[:-1]}
    text = [" | ".join(f"{c:<{widths[c]}}" for c in columns[:-1]) + " | notes"]
    text += [" | ".join(f"{str(l[c]):<{widths[c]}}" for c in columns[:-1]) + f" | {l['notes']}" for l in lines]
    return "\n".join(text)


def probe(args) -> int:
    folder = Path(args.out) / "sanitizer_probe"
    folder.mkdir(parents=True, exist_ok=True)
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(sanitizer).exists():
        log(f"compute-sanitizer not found (looked on PATH and at {sanitizer})")
        return 2
    names = [n for n in VARIANTS if not args.only or n in args.only.split(",")]
    began = time.time()
    header = dict(sanitizer=sanitizer_version(sanitizer), python=sys.version.split()[0], variants=len(names))

    log("warm-up: compile the modules once")
    warm_row = run_job(Job("warm", "", "native", mode="warm", warm_variants=tuple(names)), sanitizer, folder)
    header.update(warm_row["result"] or {"warm": f"failed (exit {warm_row['status']}), see warm.log"})
    log(f"  {header}")

    jobs = [Job(f"{n}.{tool}", n, tool) for n in names for tool in ("native", "racecheck", "synccheck")]
    jobs += [Job(f"{n}.racecheck-trace", n, "racecheck", ("--racecheck-trace-sync", "yes")) for n in TRACED if n in names]
    if "tma3d_param" in names:
        jobs.append(Job("tma3d_param.cupy-void", "tma3d_param", "native", launch="cupy-void"))
    if any(VARIANTS[n].source != "pool" for n in names):
        jobs.append(Job("bindings-encoder", "", "native", mode="bindings"))
    log(f"{len(jobs)} runs, {args.jobs} at a time, {TIMEOUT_S} s limit each")
    rows = run_all(jobs, sanitizer, folder, args.jobs)

    hazardous = [r["variant"] for r in rows if r["job"].endswith(".racecheck") and (r["racecheck"] or {}).get("hazards")]
    if hazardous:
        log(f"hazard details for {', '.join(hazardous)}")
        rows += run_all([Job(f"{n}.racecheck-hazard", n, "racecheck", ("--racecheck-report", "hazard"),
                             print_limit=HAZARD_PRINT_LIMIT) for n in hazardous], sanitizer, folder, args.jobs)

    bindings = next((r for r in rows if r["job"] == "bindings-encoder"), None)
    if bindings is not None:
        header["cuda.bindings encoder"] = bindings["result"] or f"no answer (exit {bindings['status']}; {bindings['log']})"
    cupy_void = next((r for r in rows if r["job"] == "tma3d_param.cupy-void"), None)
    if cupy_void is not None:
        header["map as CuPy numpy.void argument"] = (
            "works" if (cupy_void["result"] or {}).get("correct") else
            f"does not work (exit {cupy_void['status']}; {cupy_void['log']})")
    header["wall_s"] = round(time.time() - began, 1)
    lines = table_rows(rows)
    table = write_reports(folder, header, rows, lines)
    log("")
    for k, v in header.items():
        log(f"{k}: {v}")
    log("")
    log(table)
    log("")
    for line in verdicts(lines):
        log(line)
    log(f"\nlogs and summary.md in {folder}")
    return 0


# ---------------------------------------------------------------------- dry run (no GPU)


def dry_run(args) -> int:
    """Everything that needs no GPU: the sources compile (nvcc, both modules), the variants and
    their kernels agree, the tensor-map arguments and the cuLaunchKernel parameter layout, and
    the sanitizer-output parsers on canned lines."""
    source = SOURCE.read_text()
    for name, variant in VARIANTS.items():
        if not re.search(rf"\b{variant.kernel}\b", source):
            raise SystemExit(f"variant {name}: kernel {variant.kernel} not found in {SOURCE.name}")
    log(f"{len(VARIANTS)} variants, kernels present in {SOURCE.name}")
    for label, (fixed, brokens) in PAIRS.items():
        if unknown := [n for n in (fixed, *brokens) if n not in VARIANTS or VARIANTS[n].waits != (n == fixed)]:
            raise SystemExit(f"pair {label!r}: {', '.join(unknown)} unknown, or fixed/broken the wrong way round")
    nvcc = shutil.which("nvcc")
    if nvcc:
        with tempfile.TemporaryDirectory() as tmp:
            for module in ("core", "libcu"):
                command = [nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-cubin", *compile_options(module),
                           "-o", str(Path(tmp) / f"{module}.cubin"), str(SOURCE)]
                result = subprocess.run(command, capture_output=True, text=True, timeout=300)
                status = "ok" if result.returncode == 0 else "FAILED"
                log(f"nvcc {module}: {status}")
                if result.returncode:
                    log(result.stdout + result.stderr)
                    return 1
    else:
        log("nvcc not found: compile check skipped")

    for kind in ("map1d", "map3d"):
        margs = tensor_map_arguments(kind)
        check_tensor_map_arguments(margs)
        log(f"{kind}: rank {margs['rank']} dims {margs['dims']} strides(bytes) {margs['strides']} box {margs['box']} "
            f"-> {int(np.prod(margs['box'])) * 4} bytes per copy")
        dims = np.array(margs["dims"], dtype=np.uint64)
        log(f"  globalDim bytes: {dims.tobytes().hex(' ', 8)}")
    log("tma3d_param's parameters (cuLaunchKernel kernelParams point at each): map 128 B @0 (align 64), "
        "table ptr 8 B @128, n int32 @136, out ptr 8 B @144")
    try:
        from cuda.bindings import driver

        enums = {"INT32": (driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_INT32, TENSOR_MAP_INT32),
                 "L2_128B": (driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B, TENSOR_MAP_L2_PROMOTION_128B)}
        for label, (theirs, ours) in enums.items():
            if int(theirs) != ours:
                raise SystemExit(f"enum {label}: cuda.bindings says {int(theirs)}, this script {ours}")
        log("tensor-map enums agree with cuda.bindings.driver")
    except ImportError:
        log("cuda.bindings not installed: enum cross-check skipped")

    pool, table, expected = make_inputs()
    assert len(set(table.tolist())) == len(table) and expected.min() > 0
    canned = ("========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n"
              "========= ERROR SUMMARY: 0 errors\n"
              "========= Error: Potential RAW hazard detected at __shared__ 0x40 in block (1,0,0) :\n"
              "=========     Write Thread (0,0,0) at probe_bulk+0x940 in sanitizer_probe.cu:180\n"
              "=========     Read Thread (37,0,0) at probe_bulk+0x9f0 in sanitizer_probe.cu:60\n"
              "========= Error: Potential WAR hazard detected (CUDA barrier operation) at __shared__ 0x80 in block (0,0,0) :\n"
              "=========     Read Thread (40,0,0) (block rank 0) at probe_bulk+0x9f0\n"
              "=========     Write Thread (0,0,0) (block rank 0) at probe_bulk+0x940\n"
              "========= Barrier called by threads starting at (32,0,0) in block (1,0,0), (active mask: 0xffffffff)\n"
              + RESULT_TAG + json.dumps(dict(variant="bulk", correct=True)) + "\n")
    assert parse_racecheck(canned) == dict(hazards=2, errors=2, warnings=0)
    assert parse_error_summary(canned) == 0
    assert parse_hazard_kinds(canned) == dict(
        kinds={"RAW": 1, "WAR (CUDA barrier operation)": 1},
        pairs={"RAW": ["Write t(0,0,0) -> Read t(37,0,0)"], "WAR (CUDA barrier operation)": ["Read t(40,0,0) -> Write t(0,0,0)"]},
        reader_lanes={"RAW": "5", "WAR (CUDA barrier operation)": "8"})
    assert lane_ranges({3, 1, 2, 5, 7, 8, 31}) == "1-3,5,7-8,31" and lane_ranges(range(32)) == "0-31"
    assert parse_trace(canned) == {"Barrier": 1}
    assert parse_result(canned)["correct"] is True
    log("parsers ok; commands the probe would run, e.g.:")
    for job in (Job("bulk.native", "bulk", "native"), Job("bulk_named_empty.racecheck", "bulk_named_empty", "racecheck"),
                Job("bulk.racecheck-hazard", "bulk", "racecheck", ("--racecheck-report", "hazard"),
                    print_limit=HAZARD_PRINT_LIMIT),
                Job("tma3d_param.cupy-void", "tma3d_param", "native", launch="cupy-void")):
        log("  " + " ".join(job_command(job, "compute-sanitizer")))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "results"), help="logs go to OUT/sanitizer_probe/")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 4), help="runs at a time")
    parser.add_argument("--only", "--variants", default="", help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--dry-run", action="store_true", help="no GPU: compile, tensor-map arguments, parsers")
    parser.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--launch", choices=("cupy", "cupy-void", "driver"), help=argparse.SUPPRESS)
    parser.add_argument("--warm", metavar="VARIANTS", help=argparse.SUPPRESS)
    parser.add_argument("--check-bindings-encoder", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only and (unknown := set(args.only.split(",")) - set(VARIANTS)):
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    if args.variant:
        record = run_variant(args.variant, args.launch)
        return 0 if record["correct"] or not VARIANTS[args.variant].waits else 1
    if args.warm:
        warm(args.warm.split(","))
        return 0
    if args.check_bindings_encoder:
        check_bindings_encoder(args)
        return 0
    if args.dry_run:
        return dry_run(args)
    return probe(args)


if __name__ == "__main__":
    sys.exit(main())
