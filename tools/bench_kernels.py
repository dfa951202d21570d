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

Each GEMV is launched as the engine launches it (nanoqwen.cuda.plan: its split-K factor, ring
and carve-out); RMSNorm in decode's form (one row over a cluster of blocks) and prefill's (one
block per row).

    python3 tools/bench_kernels.py --out results/kernels-h200.md --json results/kernels-h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import numpy as np

from nanoqwen.cuda import build
from nanoqwen.cuda.abi import ARGMAX_THREADS, LM_HEAD_THREADS, RMS_CLUSTER
from nanoqwen.cuda.device import NULL, fit_gemv_rings, persistent_blocks, set_carveout
from nanoqwen.cuda.plan import GEMV_CARVEOUT_PERCENT, block_threads, gemv_launch, projection_splits
from nanoqwen.cuda.sampler import sampler_settings
from nanoqwen.cuda.timing import gpu_ms
from nanoqwen.quant import tile_int4
from nanoqwen.sampling import SamplingParams
from nanoqwen.random_model import QWEN25_CODER_7B
from record import output_path, require_gpu

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
    return gpu_ms(stream, lambda: graph.launch(stream), RUNS) / 1e3 / launches


def copy_bandwidth(cp) -> float:
    """Device-to-device cudaMemcpy, counting bytes read plus bytes written, in bytes/s. Timed
    eagerly, one copy between two events (a 2 GiB copy dwarfs the launch): captured in a graph,
    the copy became a memcpy node that ran at 2.8 TB/s instead of 4.3 on an H200."""
    src = cp.random.random(COPY_BYTES // 8)
    dst = cp.empty_like(src)
    stream = cp.cuda.get_current_stream()
    ms = gpu_ms(stream, lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                                           cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr),
                RUNS, warmup=3)
    return 2 * src.nbytes / (ms / 1e3)


def copies_for(nbytes: int, l2_bytes: int) -> int:
    return max(1, -(-3 * l2_bytes // nbytes))


def random_words(cp, shape):
    return (cp.random.random(shape) * 4294967296.0).astype(cp.uint32)


def random_scales(cp, shape):
    return (0.004 + 0.008 * cp.random.random(shape)).astype(cp.float16)


def bench_gemv(cp, module, l2_bytes, num_sms, name, kernel, projection, n, k, bias):
    """A split-K INT4 GEMV as the engine launches `projection` (or, for kernel gemv_int4_gate_up_silu,
    the fused gate+up)."""
    fused = kernel == "gemv_int4_gate_up_silu"
    rows = 2 * n if fused else n
    weight_bytes = rows * k // 2 + rows * (k // 128) * 2
    copies = copies_for(weight_bytes, l2_bytes)
    qweights = [tile_int4(random_words(cp, (rows, k // 8)), xp=cp) for _ in range(copies)]  # the engine's layout
    scales = [random_scales(cp, (rows, k // 128)) for _ in range(copies)]
    x = (cp.random.standard_normal(k, dtype=cp.float32)).astype(cp.float16)
    function = module.get_function(kernel)
    set_carveout(function, GEMV_CARVEOUT_PERCENT[kernel])
    ring_bytes = fit_gemv_rings(function, module, kernel)
    splits = projection_splits(projection, rows, k, num_sms)
    grid, block, shared_mem = gemv_launch(kernel, n, splits, ring_bytes)  # gate+up: a block per tile of gate's rows
    if fused:
        out = cp.empty(n, dtype=cp.float16)
        out_bytes = n * 2

        def launch(i):
            function(grid, block, (qweights[i], scales[i], x, out), shared_mem=shared_mem)
    else:
        out = cp.empty(n, dtype=cp.float32)
        bias_array = (0.1 * cp.random.standard_normal(n, dtype=cp.float32)).astype(cp.float16) if bias else None
        out_bytes = n * 4 + (n * 2 if bias else 0)

        def launch(i):
            function(grid, block, (qweights[i], scales[i], NULL if bias_array is None else bias_array, x, out, np.int32(n)),
                     shared_mem=shared_mem)

    seconds = median_launch_seconds(cp, launch, copies)
    shape = f"{'2x' if fused else ''}{n}x{k}"
    warps = grid[0] * block[0] // 32
    return dict(name=name, shape=shape, config=f"split {splits}, {warps} warps", seconds=seconds,
                bytes=weight_bytes + k * 2 + out_bytes)


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


def bench_select(cp, module, config, top_k: int, top_p: float):
    """argmax_select_next with a top-k (and top-p) at temperature 0.7 over the 7B's vocabulary of
    logits drawn from N(0, 3^2), already in device memory as the lm_head leaves them: the device
    sampler's three passes over the logits (which sit in L2), the sort and the draw."""
    v = config.vocab_size
    logits = 3 * cp.random.standard_normal(v, dtype=cp.float32)
    best = int(cp.argmax(logits))
    values, indices = logits[best : best + 1].copy(), cp.asarray([best], dtype=cp.int32)
    state = cp.asarray([7, 600, 601, 0, 0], dtype=cp.int32)
    sampler = cp.asarray(sampler_settings(SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, seed=1), v))
    function = module.get_function("argmax_select_next")

    def launch(_):
        function((1,), (ARGMAX_THREADS,), (values, indices, np.int32(1), state, NULL, np.int32(1), logits, sampler, NULL))

    seconds = median_launch_seconds(cp, launch, 1)
    name = f"argmax_select_next, top-k {top_k}" + (f", top-p {top_p}" if top_p < 1 else "")
    return dict(name=name, shape=f"{v} logits", config=f"1 block x {ARGMAX_THREADS}", seconds=seconds, bytes=v * 4)


def bench_rmsnorm(cp, module, l2_bytes, config, rows, cluster: bool = False):
    """add_rmsnorm over `rows` rows, one block per row, or (decode's form, `cluster`) each row over
    a cluster of RMS_CLUSTER blocks."""
    h = config.hidden_size
    per_copy = rows * h * (4 + 4 + 2)
    copies = copies_for(per_copy, l2_bytes)
    residuals = [cp.random.standard_normal((rows, h), dtype=cp.float32) for _ in range(copies)]
    deltas = [cp.random.standard_normal((rows, h), dtype=cp.float32) for _ in range(copies)]
    weight = (1 + 0.1 * cp.random.standard_normal(h, dtype=cp.float32)).astype(cp.float16)
    out = cp.empty((rows, h), dtype=cp.float16)
    name = "add_rmsnorm_cluster" if cluster else "add_rmsnorm"
    function = module.get_function(name)
    threads = block_threads(config)[name]
    blocks = rows * (RMS_CLUSTER if cluster else 1)

    def launch(i):
        function((blocks,), (threads,), (residuals[i], deltas[i], weight, out))

    seconds = median_launch_seconds(cp, launch, copies)
    form = f"each over a cluster of {RMS_CLUSTER} blocks" if cluster else "one block per row"
    return dict(name=f"add_rmsnorm, {rows} row{'s' if rows > 1 else ''}, {form}",
                shape=f"{rows}x{h}", config=f"{blocks} blocks x {threads}", seconds=seconds,
                bytes=rows * h * (4 + 4 + 4 + 2) + h * 2)


def command(out: Path | None, json_path: Path | None) -> str:
    """The command that makes the record again, writing to results/ under the names it was given."""
    return " ".join(["python3 tools/bench_kernels.py"] + [f"{flag} results/{path.name}" for flag, path in
                                                           (("--out", out), ("--json", json_path)) if path is not None])


def run(out: Path | None, json_path: Path | None) -> list[dict]:
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
        bench_gemv(cp, module, l2_bytes, num_sms, "q|k|v (+bias)", "gemv_int4_from_hidden", "qkv", q + 2 * kv, h, True),
        bench_gemv(cp, module, l2_bytes, num_sms, "o_proj", "gemv_int4_from_q_dim", "o", h, q, False),
        bench_gemv(cp, module, l2_bytes, num_sms, "gate+up, SwiGLU fused", "gemv_int4_gate_up_silu", "gate_up", i, h, False),
        bench_gemv(cp, module, l2_bytes, num_sms, "down_proj", "gemv_int4_from_intermediate", "down", h, i, False),
        bench_lm_head(cp, module, num_sms, config),
        bench_lm_head(cp, module, num_sms, config, temperature=0.7),
        bench_select(cp, module, config, 40, 1.0),
        bench_select(cp, module, config, 40, 0.95),
        bench_select(cp, module, config, 1024, 0.95),
        bench_rmsnorm(cp, module, l2_bytes, config, 1, cluster=True),
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
        f"command: {command(out, json_path)}",
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
    text = "# Decode kernels one at a time at the 7B's shapes\n\n" + "\n".join(f"- {line}" if line and not line.startswith("|")
                                                                         else line for line in lines) + "\n"
    print(text)
    if out is not None:
        out.write_text(text)
    if json_path is not None:
        json_path.write_text(json.dumps({"date": datetime.date.today().isoformat(), "gpu": gpu_name, "command": command(out, json_path),
                                         "copy_bandwidth": copy, "read_only_tbps": READ_ONLY_TBPS, "rows": results}, indent=1))
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=output_path, help="also write the table (Markdown) here")
    parser.add_argument("--json", type=output_path, help="also write every row as JSON here")
    args = parser.parse_args(argv)
    require_gpu("bench_kernels")
    run(args.out, args.json)


if __name__ == "__main__":
    main()
