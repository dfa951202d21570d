"""Bandwidth of the decode kernels at Qwen2.5-Coder-7B's shapes, on the GPU at hand.

Each GEMV of one decoded token reads its weight matrix once, so its floor is bytes / bandwidth.
For every projection shape (and the fp16 lm_head, and RMSNorm) this script counts the bytes
the kernel must move, times it with CUDA events and compares the rate with the device-to-device
copy bandwidth measured in the same run (bytes read + bytes written) and with the 4.49 TB/s
that a read-only streaming kernel reached on an H200 (notes: hopper-from-python.md).

Timing: after a warm-up, the median over RUNS replays of a CUDA graph holding max(BATCH,
copies) launches, each on a different copy of the weights (enough copies to exceed 3x the L2
cache), so no launch finds its matrix in L2 and no launch waits for the host. The time per
launch therefore includes the ~1 µs gap between consecutive kernels of a graph, as in the
engine's captured decode step. Random weights, never zeros.

`--l2-probe` adds one question about the two big GEMVs: held up by DRAM or inside the SM? It
times each over a share of its row tiles, streaming its weights from DRAM, and again reading one
copy that stays in L2.

    PYTHONPATH=. python3 tools/bench_kernels.py --out results/bench.md [--sweep] [--l2-probe]
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import numpy as np

from nanoqwen.cuda import build
from nanoqwen.cuda.abi import LM_HEAD_THREADS
from nanoqwen.cuda.device import NULL, fit_gemv_rings, persistent_blocks
from nanoqwen.cuda.plan import GATE_UP_SPLITS, GEMV_STAGES_MACROS, block_threads, gemv_launch, gemv_splits
from nanoqwen.cuda.sampler import sampler_settings
from nanoqwen.quant import tile_int4
from nanoqwen.sampling import SamplingParams
from nanoqwen.random_model import QWEN25_CODER_7B

READ_ONLY_TBPS = 4.49  # a read-only 16-byte streaming kernel on an H200 (notes)
RUNS, BATCH = 30, 10
COPY_BYTES = 2 * 2**30
BYTE_FLOORS = (
    "INT4 GEMV N x K: packed weights N*K/2 + fp16 scales N*K/64 + x 2K + fp32 out 4N "
    "(+ bias 2N); the fused gate+up reads two N x K matrices and writes N fp16; lm_head V x H: fp16 weights "
    "2*V*H + x 2H + fp32 logits 4V + one (value, index) per block; add_rmsnorm T x H: residual read and "
    "written 8TH + delta 4TH + fp16 out 2TH + weight 2H."
)


def median_launch_seconds(cp, launch, copies: int) -> float:
    """Median time of one launch. launch(i) runs on copy i % copies of the inputs; max(BATCH,
    copies) launches are captured in one CUDA graph, so the host's launch cost (several µs per
    launch from Python, more than a small GEMV takes) stays out of the timing, as in the
    engine's captured decode step."""
    launches = max(BATCH, copies)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(3):
            launch(i % copies)
        stream.begin_capture()
        for i in range(launches):
            launch(i % copies)
        graph = stream.end_capture()
        graph.upload(stream)
        graph.launch(stream)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(RUNS):
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / launches)
    return float(np.median(times))


def copy_bandwidth(cp) -> float:
    """Device-to-device cudaMemcpy, counting bytes read plus bytes written, in bytes/s. Timed
    eagerly, one copy between two events (a 2 GiB copy dwarfs the launch): captured in a graph,
    the copy became a memcpy node that ran at 2.8 TB/s instead of 4.3 on an H200."""
    src = cp.random.random(COPY_BYTES // 8)
    dst = cp.empty_like(src)
    stream = cp.cuda.get_current_stream()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for run in range(3 + RUNS):
        start.record(stream)
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                    stream.ptr)
        end.record(stream)
        end.synchronize()
        if run >= 3:
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return 2 * src.nbytes / float(np.median(times))


def copies_for(nbytes: int, l2_bytes: int) -> int:
    return max(1, -(-3 * l2_bytes // nbytes))


def random_words(cp, shape):
    return (cp.random.random(shape) * 4294967296.0).astype(cp.uint32)


def random_scales(cp, shape):
    return (0.004 + 0.008 * cp.random.random(shape)).astype(cp.float16)


def bench_gemv(cp, module, l2_bytes, num_sms, name, kernel, n, k, bias, warps_per_sm=None, tile_share=1,
               resident=False):
    """A split-K INT4 GEMV (or, for kernel gemv_int4_gate_up_silu, the fused gate+up). With
    `tile_share` s the launch covers only the first 1/s of its row tiles (and of the bytes); with
    `resident` every launch reads the same copy of the weights, which then stays in L2 if it fits."""
    fused = kernel == "gemv_int4_gate_up_silu"
    rows = 2 * n if fused else n
    weight_bytes = rows * k // 2 + rows * (k // 128) * 2
    copies = 1 if resident else copies_for(weight_bytes // tile_share, l2_bytes)
    qweights = [tile_int4(random_words(cp, (rows, k // 8)), xp=cp) for _ in range(copies)]  # the engine's layout
    scales = [random_scales(cp, (rows, k // 128)) for _ in range(copies)]
    x = (cp.random.standard_normal(k, dtype=cp.float32)).astype(cp.float16)
    function = module.get_function(kernel)
    ring_bytes = fit_gemv_rings(function, module, kernel)
    if fused:
        splits, out = GATE_UP_SPLITS, cp.empty(n, dtype=cp.float16)
        grid, block, shared_mem = gemv_launch(kernel, n // tile_share, splits, ring_bytes)
        out_bytes = n // tile_share * 2

        def launch(i):
            function(grid, block, (qweights[i], scales[i], x, out), shared_mem=shared_mem)
    else:
        splits = gemv_splits(n, k, num_sms, **({} if warps_per_sm is None else {"warps_per_sm": warps_per_sm}))
        out = cp.empty(n, dtype=cp.float32)
        bias_array = (0.1 * cp.random.standard_normal(n, dtype=cp.float32)).astype(cp.float16) if bias else None
        grid, block, shared_mem = gemv_launch(kernel, n // tile_share, splits, ring_bytes)
        out_bytes = (n * 4 + (n * 2 if bias else 0)) // tile_share

        def launch(i):
            function(grid, block, (qweights[i], scales[i], NULL if bias_array is None else bias_array, x, out, np.int32(n)),
                     shared_mem=shared_mem)

    seconds = median_launch_seconds(cp, launch, copies)
    shape = f"{'2x' if fused else ''}{n}x{k}"
    warps = grid[0] * block[0] // 32
    return dict(name=name, shape=shape, config=f"split {splits}, {warps} warps", seconds=seconds,
                bytes=weight_bytes // tile_share + k * 2 + out_bytes)


def l2_probe(cp, module, l2_bytes, num_sms, config) -> list[str]:
    """Is a big GEMV held up by DRAM or by its SMs? The same launch over a share of its tiles, its
    weights streamed from DRAM (rotating copies) or read again from L2 (one copy, replayed): if
    L2's shorter round trips barely help, the time goes inside the SM."""
    h, i = config.hidden_size, config.intermediate_size
    lines = ["| GEMV | tiles launched | weights from | median µs | MB | TB/s |", "| --- | ---: | --- | ---: | ---: | ---: |"]
    for label, kernel, n, k in (("gate+up", "gemv_int4_gate_up_silu", i, h), ("down", "gemv_int4_from_intermediate", h, i)):
        for share, resident in ((1, False), (2, False), (2, True), (4, True)):
            r = bench_gemv(cp, module, l2_bytes, num_sms, label, kernel, n, k, False, tile_share=share, resident=resident)
            lines.append(f"| {label} | 1/{share} | {'L2 (one copy)' if resident else 'DRAM (copies)'} | "
                         f"{r['seconds'] * 1e6:.2f} | {r['bytes'] / 1e6:.1f} | {r['bytes'] / r['seconds'] / 1e12:.2f} |")
    return lines


def bench_lm_head(cp, module, num_sms, config, temperature: float = 0.0):
    """The lm_head and its per-block candidates: greedy, or with the sampler's Gumbel noise at
    `temperature` (nanoqwen.sampling), which each warp computes while its row's loads are in flight."""
    v, h = config.vocab_size, config.hidden_size
    weight = (0.02 * cp.random.standard_normal((v, h), dtype=cp.float32)).astype(cp.float16)
    x = cp.random.standard_normal(h, dtype=cp.float32).astype(cp.float16)
    function = module.get_function("lm_head_logits")
    blocks = persistent_blocks(function, LM_HEAD_THREADS, num_sms)
    logits = cp.empty(v, dtype=cp.float32)
    values, indices = cp.empty(blocks, dtype=cp.float32), cp.empty(blocks, dtype=cp.int32)
    state = cp.asarray([0, 600, 601, 0, 0], dtype=cp.int32)
    sampler = cp.asarray(sampler_settings(SamplingParams(temperature=temperature, seed=1), v))

    def launch(_):
        function((blocks,), (LM_HEAD_THREADS,), (x, weight, logits, values, indices, state, sampler))

    seconds = median_launch_seconds(cp, launch, 1)  # 1.09 GB: far larger than L2 already
    name = "lm_head (fp16) + argmax stage 1" + (f", sampling at temperature {temperature}" if temperature else "")
    return dict(name=name, shape=f"{v}x{h}", config=f"{blocks} blocks x {LM_HEAD_THREADS}",
                seconds=seconds, bytes=v * h * 2 + h * 2 + v * 4 + blocks * 8)


def bench_rmsnorm(cp, module, l2_bytes, config, rows):
    h = config.hidden_size
    per_copy = rows * h * (4 + 4 + 2)
    copies = copies_for(per_copy, l2_bytes)
    residuals = [cp.random.standard_normal((rows, h), dtype=cp.float32) for _ in range(copies)]
    deltas = [cp.random.standard_normal((rows, h), dtype=cp.float32) for _ in range(copies)]
    weight = (1 + 0.1 * cp.random.standard_normal(h, dtype=cp.float32)).astype(cp.float16)
    out = cp.empty((rows, h), dtype=cp.float16)
    function = module.get_function("add_rmsnorm")
    threads = block_threads(config)["add_rmsnorm"]

    def launch(i):
        function((rows,), (threads,), (residuals[i], deltas[i], weight, out))

    seconds = median_launch_seconds(cp, launch, copies)
    return dict(name=f"add_rmsnorm, {rows} row{'s' if rows > 1 else ''}",
                shape=f"{rows}x{h}", config=f"{rows} blocks x {threads}", seconds=seconds,
                bytes=rows * h * (4 + 4 + 4 + 2) + h * 2)


def sweep(cp, l2_bytes, num_sms, config) -> list[str]:
    """The INT4 GEMV's two tuning knobs on the shapes that carry the bytes: the depth of the
    copy ring (compile time) and the split-K target in warps per SM (launch time)."""
    h, i = config.hidden_size, config.intermediate_size
    lines = ["| ring stages | warps/SM target | gate+up us | down us | fused qkv us | o us | regs (gate+up, down) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for stages in (4, 8, 12):
        module = build.compile_module(config,
                                           extra_defines={macro: str(stages) for macro in GEMV_STAGES_MACROS.values()})
        regs = (module.get_function("gemv_int4_gate_up_silu").num_regs,
                module.get_function("gemv_int4_from_intermediate").num_regs)
        gate_up = bench_gemv(cp, module, l2_bytes, num_sms, "", "gemv_int4_gate_up_silu", i, h, False)["seconds"]
        for target in (8, 12, 20):
            times = [bench_gemv(cp, module, l2_bytes, num_sms, "", kernel, n, k, bias, target)["seconds"]
                     for kernel, n, k, bias in (("gemv_int4_from_intermediate", h, i, False),
                                                ("gemv_int4_from_hidden", config.q_dim + 2 * config.kv_dim, h, True),
                                                ("gemv_int4_from_q_dim", h, config.q_dim, False))]
            lines.append(f"| {stages} | {target} | {gate_up * 1e6:.1f} | " + " | ".join(f"{t * 1e6:.1f}" for t in times)
                         + f" | {regs} |")
    return lines


def run(out: Path | None, with_sweep: bool = False, with_l2_probe: bool = False) -> list[dict]:
    import cupy as cp

    config = QWEN25_CODER_7B
    device = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(device.id)
    gpu_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    l2_bytes, num_sms = props["l2CacheSize"], props["multiProcessorCount"]
    module = build.compile_module(config)
    copy = copy_bandwidth(cp)

    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_dim, config.kv_dim
    results = [
        bench_gemv(cp, module, l2_bytes, num_sms, "q_proj (+bias)", "gemv_int4_from_hidden", q, h, True),
        bench_gemv(cp, module, l2_bytes, num_sms, "k_proj (+bias)", "gemv_int4_from_hidden", kv, h, True),
        bench_gemv(cp, module, l2_bytes, num_sms, "v_proj (+bias)", "gemv_int4_from_hidden", kv, h, True),
        bench_gemv(cp, module, l2_bytes, num_sms, "fused qkv (+bias)", "gemv_int4_from_hidden", q + 2 * kv, h, True),
        bench_gemv(cp, module, l2_bytes, num_sms, "o_proj", "gemv_int4_from_q_dim", h, q, False),
        bench_gemv(cp, module, l2_bytes, num_sms, "gate+up, SwiGLU fused", "gemv_int4_gate_up_silu", i, h, False),
        bench_gemv(cp, module, l2_bytes, num_sms, "down_proj", "gemv_int4_from_intermediate", h, i, False),
        bench_lm_head(cp, module, num_sms, config),
        bench_lm_head(cp, module, num_sms, config, temperature=0.7),
        bench_rmsnorm(cp, module, l2_bytes, config, 1),
        bench_rmsnorm(cp, module, l2_bytes, config, 8192),
    ]
    for r in results:
        r["gbps"] = r["bytes"] / r["seconds"] / 1e9
        r["of_copy"] = r["bytes"] / r["seconds"] / copy
        r["of_read_only"] = r["gbps"] / (READ_ONLY_TBPS * 1e3)

    lines = [
        f"date: {datetime.date.today().isoformat()}; GPU: {gpu_name} ({num_sms} SMs, L2 {l2_bytes / 2**20:.0f} MiB); "
        f"CuPy {cp.__version__}",
        "command: PYTHONPATH=. python3 tools/bench_kernels.py" + " --sweep" * with_sweep + " --l2-probe" * with_l2_probe,
        f"device-to-device copy (read + write counted): {copy / 1e12:.2f} TB/s; "
        f"read-only reference {READ_ONLY_TBPS} TB/s",
        f"median of {RUNS} replays of a CUDA graph of max({BATCH}, copies) launches, inputs rotated over >= 3x L2",
        "",
        "| kernel | shape | launch | median us | bytes (floor) | GB/s | of copy BW | of 4.49 TB/s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['shape']} | {r['config']} | {r['seconds'] * 1e6:.1f} | {r['bytes'] / 1e6:.2f} MB "
            f"| {r['gbps']:.0f} | {r['of_copy']:.0%} | {r['of_read_only']:.0%} |"
        )
    lines += ["", "Byte floors (each input read once, each output written once): " + BYTE_FLOORS]
    if with_sweep:
        lines += ["", "INT4 GEMV tuning sweep (median us per launch, same timing):", ""]
        lines += sweep(cp, l2_bytes, num_sms, config)
    if with_l2_probe:
        lines += ["", "L2 probe (same timing; a share of the row tiles, weights from DRAM or L2-resident):", ""]
        lines += l2_probe(cp, module, l2_bytes, num_sms, config)
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        out.write_text(text)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table (Markdown) here")
    parser.add_argument("--sweep", action="store_true", help="also time other ring depths and split-K targets")
    parser.add_argument("--l2-probe", action="store_true",
                        help="also time gate+up and down over a share of their tiles, weights from DRAM or from L2")
    args = parser.parse_args(argv)
    run(args.out, args.sweep, args.l2_probe)


if __name__ == "__main__":
    main()
