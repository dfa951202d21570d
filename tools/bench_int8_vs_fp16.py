"""Path A (INT8 activations, __dp4a) against Path B (fp16 activations, the engine's GEMV) on
every INT4 projection shape of Qwen2.5-Coder-7B, on one GPU. Chapter 8 plots what it writes.

    python3 tools/bench_int8_vs_fp16.py [--replays 20] [--json PATH]

For each shape (N outputs x K inputs) it times, per call:
    A total   quantize_activations_int8 + gemv_int4_int8   (kernels/gemv_int4_int8.cu)
    A GEMV    gemv_int4_int8 alone (activations already quantized)
    A quant   quantize_activations_int8 alone
    B         gemv_int4_from_<width> (kernels/gemv_int4.cu), launched by nanoqwen.cuda.backend's
              own code with its split-K choice (a block of warps per tile adds the splits)
    B fused   (gate+up only) gemv_int4_gate_up_silu, the kernel the engine runs there
Method: every variant is captured in a CUDA graph of many calls that rotate over copies of
the weights filling 4x the L2, so each call streams its weights from HBM; a replay is timed
with CUDA events after a spin kernel has given the host time to queue it (no host gap inside
the timed span). Time per call = replay time / calls, so the gaps between kernels of a graph
are included, as in the engine's decode graph. Median over all replays of two rounds; each
round's median is kept in the JSON to show the noise. Bytes per call count weights, scales,
activations in and results out; bandwidth is compared with a 1 GiB device-to-device copy
(read + write counted) measured in the same run, and with the time of a graph of empty kernels
(the launch floor). Errors are measured against the fp16 activations times the dequantized
fp32 weights, in float64 (nanoqwen.book.int8_study.dequantized_reference), on synthetic activations
with outlier channels; Path A is also checked bit for bit against its numpy oracle.

Writes the JSON to --json (default $OUT/int8_vs_fp16.json, else ./int8_vs_fp16.json) and
prints a Markdown table last. Exit status 2 when no GPU is usable, 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

from nanoqwen.book.int8_study import (
    PROJECTION_OF,
    dequantized_reference,
    error_vs_reference,
    synthetic_activations,
)
from nanoqwen.cuda.int8 import Int8Gemv, int4_int8_linear, quantize_activations_int8
from nanoqwen.cuda.backend import CudaBackend
from nanoqwen.cuda.device import fit_gemv_rings
from nanoqwen.cuda.plan import gemv_launch, projection_splits
from nanoqwen.cuda.timing import gpu_times_ms
from nanoqwen.cuda.weights import DeviceLinear
from nanoqwen.loader import Int4Linear
from nanoqwen.quant import tile_int4
from nanoqwen.random_model import QWEN25_CODER_7B
from record import output_path

CONFIG = QWEN25_CODER_7B
C = CONFIG
# (name, N, K, input width: the kernel suffix of both paths)
SHAPES = [
    ("q", C.q_dim, C.hidden_size, "hidden"),
    ("k", C.kv_dim, C.hidden_size, "hidden"),
    ("v", C.kv_dim, C.hidden_size, "hidden"),
    ("qkv", C.q_dim + 2 * C.kv_dim, C.hidden_size, "hidden"),
    ("o", C.hidden_size, C.q_dim, "q_dim"),
    ("gate+up", 2 * C.intermediate_size, C.hidden_size, "hidden"),
    ("down", C.hidden_size, C.intermediate_size, "intermediate"),
]
ROTATION_L2_MULTIPLE = 4  # the rotated weight copies fill this many L2 caches
MIN_CALLS = 64  # calls per graph replay, at least
MIN_BYTES_PER_REPLAY = 512 << 20  # and at least this many weight bytes streamed per replay
COPY_BYTES = 1 << 30
SPIN_CYCLES = 200_000  # ~100 us at ~2 GHz: longer than the host needs to queue a replay

HELPERS_SOURCE = r"""
extern "C" __global__ void empty_kernel() {}
extern "C" __global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {}
}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replays", type=int, default=20, help="timed graph replays per variant and round")
    parser.add_argument("--json", type=output_path, default=None, help="where to write the results")
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated subset")
    args = parser.parse_args()
    json_path = args.json or Path(os.environ.get("OUT", ".")) / "int8_vs_fp16.json"
    wanted = args.shapes.split(",")
    unknown = [w for w in wanted if w not in {s[0] for s in SHAPES}]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {[s[0] for s in SHAPES]}")

    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:
        print(f"bench_int8_vs_fp16: needs CuPy and a CUDA GPU ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2

    started = time.perf_counter()
    device = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(device.id)
    num_sms = device.attributes["MultiProcessorCount"]
    l2_bytes = device.attributes["L2CacheSize"]
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "sm_count": num_sms,
        "l2_bytes": l2_bytes,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cp.cuda.runtime.driverGetVersion(),
        "cupy": cp.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "replays_per_round": args.replays,
        "rounds": 2,
        "activations": "nanoqwen.book.int8_study.synthetic_activations (lognormal channel gains, 0.4% outlier channels x20, Laplace)",
        "weights": "uniformly random packed words (every nibble value), fp16 scales uniform in [0.004, 0.012]",
    }
    print(f"# {meta['gpu']}, {num_sms} SMs, L2 {l2_bytes >> 20} MiB, CuPy {cp.__version__}", flush=True)

    helpers = cp.RawModule(code=HELPERS_SOURCE)
    empty_kernel, spin = helpers.get_function("empty_kernel"), helpers.get_function("spin")
    stream = cp.cuda.Stream(non_blocking=True)
    timer = GraphTimer(cp, stream, spin, args.replays)

    copy = measure_copy(cp, stream, timer)
    print(f"# device-to-device copy: {copy['gbps']:.0f} GB/s (read + write counted)", flush=True)
    path_b, path_b_reason = path_b_kernels(cp)
    print(f"# Path B: {'kernels/gemv_int4.cu via nanoqwen.cuda.backend' if path_b else 'MISSING: ' + path_b_reason}",
          flush=True)

    rng = np.random.default_rng(20260101)
    results, failures = [], []
    for name, n, k, width in SHAPES:
        if name not in wanted:
            continue
        shape_started = time.perf_counter()
        entry = bench_shape(cp, stream, timer, empty_kernel, path_b, name, n, k, width, l2_bytes, num_sms, copy, rng)
        results.append(entry)
        if not entry["a_matches_oracle"]:
            failures.append(f"{name}: Path A differs from its numpy oracle")
        t = entry["time_us"]
        b_part = f", B {t['b']['median']:.2f}" if "b" in t else ", B missing"
        print(f"# {name}: A quant+GEMV {t['a_total']['median']:.2f} us, A GEMV {t['a_gemv']['median']:.2f} us"
              f"{b_part}; A error {entry['error']['a']['rel_l2']:.1e}; {time.perf_counter() - shape_started:.1f} s",
              flush=True)

    report = {
        "meta": meta,
        "copy": copy,
        "path_b": {"available": path_b is not None, "reason": path_b_reason},
        "shapes": results,
        "failures": failures,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2))
    print(f"# wrote {json_path} ({report['wall_seconds']} s)\n")
    print(markdown_table(report))
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


# ----------------------------------------------------------------------------- timing


class GraphTimer:
    """Capture `issue()` (which launches `calls` calls on the current stream) into a graph,
    then time replays with CUDA events; returns microseconds per call."""

    def __init__(self, cp, stream, spin, replays: int):
        self.cp, self.stream, self.spin, self.replays = cp, stream, spin, replays

    def capture(self, issue):
        stream = self.stream
        with stream:
            issue()  # warm-up outside the capture: compilation, module load, first touches
            stream.synchronize()
            stream.begin_capture()
            issue()
            graph = stream.end_capture()
        graph.upload(stream)
        graph.launch(stream)
        stream.synchronize()
        return graph

    def time(self, graph, calls: int) -> list[float]:
        stream = self.stream

        def spin():
            with stream:
                self.spin((1,), (1,), (np.int64(SPIN_CYCLES),))

        return [ms * 1e3 / calls for ms in gpu_times_ms(stream, lambda: graph.launch(stream), self.replays,
                                                        warmup=0, prepare=spin)]


def summary(rounds: list[list[float]]) -> dict:
    every = np.concatenate([np.asarray(r) for r in rounds])
    return {
        "median": float(np.median(every)),
        "p10": float(np.percentile(every, 10)),
        "p90": float(np.percentile(every, 90)),
        "round_medians": [float(np.median(r)) for r in rounds],
    }


def measure_copy(cp, stream, timer) -> dict:
    src = cp.random.random(COPY_BYTES // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    cp.cuda.Device().synchronize()  # src is written on the null stream, copied on `stream`
    times = [ms * 1e3 for ms in gpu_times_ms(
        stream, lambda d=dst, s=src: cp.cuda.runtime.memcpyAsync(d.data.ptr, s.data.ptr, COPY_BYTES, 3, stream.ptr),  # 3: device to device
        2 * timer.replays, warmup=3)]
    if not bool((dst == src).all()):
        raise RuntimeError("the device-to-device copy did not copy")
    median_us = float(np.median(times))
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return {"bytes": COPY_BYTES, "median_us": median_us, "gbps": 2 * COPY_BYTES / median_us / 1e3}


# ----------------------------------------------------------------------------- the two paths


def path_b_kernels(cp):
    """The engine's GEMV kernels, compiled as the engine compiles them; (None, why) if absent."""
    from nanoqwen.cuda import build

    try:
        module = build.compile_module(CONFIG, files=("gemv_int4.cu",))
    except Exception as exc:  # the kernel file does not compile here
        return None, f"{type(exc).__name__}: {exc}"
    kernels = {f"gemv_int4_from_{w}": module.get_function(f"gemv_int4_from_{w}")
               for w in ("hidden", "q_dim", "intermediate")}
    kernels["gemv_int4_gate_up_silu"] = module.get_function("gemv_int4_gate_up_silu")
    ring_bytes = {name: fit_gemv_rings(function, module, name) for name, function in kernels.items()}
    return types.SimpleNamespace(kernels=kernels, ring_bytes=ring_bytes), None


class PathB:
    """One projection through the engine's decode GEMV, launched by CudaBackend._gemv itself
    (it reads nothing of the backend but `kernels`), with the engine's split-K factor, on its own
    copy of the weights in the engine's tiled layout."""

    def __init__(self, cp, path_b, shape: str, width: str, qweight, scales, num_sms: int):
        n, k = qweight.shape[0], qweight.shape[1] * 8
        splits = projection_splits(PROJECTION_OF[shape], n, k, num_sms, CONFIG.group_size)
        self.linear = DeviceLinear(qweight=tile_int4(qweight, xp=cp), scales=scales, bias=None, bias32=None,
                                      out_features=n, in_features=k, splits=splits)
        self.kernel_name = f"gemv_int4_from_{width}"
        self.out = cp.empty(n, dtype=cp.float32)
        self._launcher = types.SimpleNamespace(kernels=path_b.kernels, gemv_ring_bytes=path_b.ring_bytes)
        self._gemv = CudaBackend._gemv

    def __call__(self, x) -> None:
        self._gemv(self._launcher, self.kernel_name, self.linear, x, self.out)


def fused_gate_up(cp, path_b, linear: DeviceLinear, x, h) -> None:
    """The engine's launch of gemv_int4_gate_up_silu (as in CudaBackend.decode_step_launches) over
    `linear`, gate's rows then up's, at its split."""
    name = "gemv_int4_gate_up_silu"
    grid, block, shared_mem = gemv_launch(name, linear.out_features // 2, linear.splits, path_b.ring_bytes[name])
    path_b.kernels[name](grid, block, (linear.qweight, linear.scales, x, h), shared_mem=shared_mem)


# ----------------------------------------------------------------------------- one shape


def bench_shape(cp, stream, timer, empty_kernel, path_b, name, n, k, width, l2_bytes, num_sms, copy, rng) -> dict:
    groups = k // CONFIG.group_size
    weight_bytes, scale_bytes = n * k // 2, n * groups * 2
    per_copy = weight_bytes + scale_bytes
    copies = max(2, math.ceil(ROTATION_L2_MULTIPLE * l2_bytes / per_copy))
    calls = max(MIN_CALLS, math.ceil(MIN_BYTES_PER_REPLAY / per_copy))
    calls = math.ceil(calls / copies) * copies  # whole passes over the copies

    qweight = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32)
    scales = rng.uniform(0.004, 0.012, (n, groups)).astype(np.float16)
    x_host = synthetic_activations(k, rng)
    with stream:
        qw = [cp.asarray(qweight)]
        sc = [cp.asarray(scales)]
        for _ in range(copies - 1):
            qw.append(qw[0].copy())
            sc.append(sc[0].copy())
        xs = [cp.asarray(x_host) for _ in range(copies)]
        ys = [cp.empty(n, dtype=cp.float32) for _ in range(copies)]
        a = [Int8Gemv(CONFIG, qw[i], sc[i]) for i in range(copies)]
        ys[0].fill(np.nan)
        a[0](xs[0], ys[0])  # correctness and error first, on copy 0
    b, b_error = None, None
    if path_b:
        try:  # a Path B that does not fit this script is reported, not fatal
            with stream:
                b = [PathB(cp, path_b, name, width, qw[i], sc[i], num_sms) for i in range(copies)]
                b[0].out.fill(np.nan)
                b[0](xs[0])
        except Exception as exc:
            b, b_error = None, f"{type(exc).__name__}: {exc}"
            print(f"# {name}: Path B failed: {b_error}", flush=True)
    fused = name == "gate+up" and b is not None
    with stream:
        hs = [cp.empty(CONFIG.intermediate_size, dtype=cp.float16) for _ in range(copies)] if fused else None
    stream.synchronize()
    linear = Int4Linear(qweight, scales, None)
    reference = dequantized_reference(x_host, linear)
    y_a = cp.asnumpy(ys[0])
    q, xscale = quantize_activations_int8(x_host)
    a_matches = bool(np.array_equal(y_a, int4_int8_linear(q, xscale, linear)))
    error = {"a": error_vs_reference(y_a, reference)}
    if b:
        y_b = cp.asnumpy(b[0].out).astype(np.float64)
        error["b"] = error_vs_reference(y_b, reference)

    variants = {
        "a_total": lambda i: a[i](xs[i], ys[i]),
        "a_gemv": lambda i: a[i].gemv(ys[i]),
        "a_quant": lambda i: a[i].quantize(xs[i]),
        "empty": lambda i: empty_kernel((1,), (32,), ()),
    }
    if b:
        variants["b"] = lambda i: b[i](xs[i])
    if fused:
        variants["b_fused_silu"] = lambda i: fused_gate_up(cp, path_b, b[i].linear, xs[i], hs[i])
    graphs = {}
    for variant, call in variants.items():
        graphs[variant] = timer.capture(lambda call=call: [call(i % copies) for i in range(calls)])
    rounds = {variant: [] for variant in variants}
    for _ in range(2):  # two rounds, variants interleaved: drift shows as a round difference
        for variant, graph in graphs.items():
            rounds[variant].append(timer.time(graph, calls))
    times = {variant: summary(r) for variant, r in rounds.items()}
    del graphs

    act_in, out_f32 = 2 * k, 4 * n
    xq_bytes, xscale_bytes = k, 4 * groups
    bytes_moved = {
        "weights": weight_bytes,
        "scales": scale_bytes,
        "a_quant": act_in + xq_bytes + xscale_bytes,
        "a_gemv": weight_bytes + scale_bytes + xq_bytes + xscale_bytes + out_f32,
    }
    bytes_moved["a_total"] = bytes_moved["a_quant"] + bytes_moved["a_gemv"]
    if b:
        bytes_moved["b"] = weight_bytes + scale_bytes + act_in + out_f32
    if fused:
        bytes_moved["b_fused_silu"] = weight_bytes + scale_bytes + act_in + 2 * CONFIG.intermediate_size
    gbps = {v: bytes_moved[v] / times[v]["median"] / 1e3 for v in bytes_moved if v in times}
    entry = {
        "name": name,
        "n": n,
        "k": k,
        "width": width,
        "copies": copies,
        "calls_per_replay": calls,
        "b_splits": b[0].linear.splits if b else None,
        "b_error": b_error,
        "bytes": bytes_moved,
        "floor_us_at_copy_bandwidth": (weight_bytes + scale_bytes) / copy["gbps"] / 1e3,
        "time_us": times,
        "gbps": gbps,
        "fraction_of_copy": {v: g / copy["gbps"] for v, g in gbps.items()},
        "error": error,
        "a_matches_oracle": a_matches,
    }
    for objects in (a, b, qw, sc, xs, ys, hs):
        if objects:
            objects.clear()
    cp.get_default_memory_pool().free_all_blocks()
    return entry


# ----------------------------------------------------------------------------- report


def markdown_table(report: dict) -> str:
    copy = report["copy"]
    lines = [
        f"{report['meta']['gpu']}, {report['meta']['date_utc']}; copy {copy['gbps']:.0f} GB/s (read+write); "
        "times are us per call inside a CUDA graph, median of "
        f"{report['meta']['rounds']} x {report['meta']['replays_per_round']} replays",
        "",
        "| shape | N x K | weights+scales MB | floor us | empty kernel us | A quant+GEMV us | A GEMV us | "
        "A quant us | B us | A total / B | A GEMV GB/s (% copy) | B GB/s (% copy) | A error | B error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in report["shapes"]:
        t, g, f = s["time_us"], s["gbps"], s["fraction_of_copy"]
        mb = (s["bytes"]["weights"] + s["bytes"]["scales"]) / 1e6
        b = t.get("b")
        b_time = f"{b['median']:.2f}" if b else "missing"
        ratio = f"{t['a_total']['median'] / b['median']:.2f}" if b else "n/a"
        b_bw = f"{g['b']:.0f} ({100 * f['b']:.0f}%)" if b else "n/a"
        b_err = f"{s['error']['b']['rel_l2']:.1e}" if "b" in s["error"] else "n/a"
        lines.append(
            f"| {s['name']} | {s['n']} x {s['k']} | {mb:.1f} | {s['floor_us_at_copy_bandwidth']:.2f} | "
            f"{t['empty']['median']:.2f} | {t['a_total']['median']:.2f} | {t['a_gemv']['median']:.2f} | "
            f"{t['a_quant']['median']:.2f} | {b_time} | {ratio} | {g['a_gemv']:.0f} ({100 * f['a_gemv']:.0f}%) | "
            f"{b_bw} | {s['error']['a']['rel_l2']:.1e} | {b_err} |"
        )
        if "b_fused_silu" in t:
            lines.append(
                f"| gate+up, engine's fused SiLU kernel | | | | | | | | {t['b_fused_silu']['median']:.2f} | "
                f"{t['a_total']['median'] / t['b_fused_silu']['median']:.2f} | | "
                f"{g['b_fused_silu']:.0f} ({100 * f['b_fused_silu']:.0f}%) | | |"
            )
    if not report["path_b"]["available"]:
        lines.append(f"\nPath B missing: {report['path_b']['reason']}")
    lines.append("\nerror: ||y - y_ref|| / ||y_ref||, y_ref = fp16 x times dequantized fp32 weights, in float64")
    return "\n".join(lines)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
