"""Check and time the paged attention kernels on a GPU, and write results/attention-<gpu>.md.

    python3 tools/gpu_check_attention.py          # everything (~3 minutes on an H200)
    python3 tools/gpu_check_attention.py --quick  # a kernel change's check (~2 minutes)

Sections, each independent (a failure is recorded and the next one runs):

1. correctness: decode and prefill against nanoqwen.reference.ops.paged_attention at lengths 1, 15,
   16, 17, 640, 4096 and 32768, for the 7B's shape (28 query heads, 4 KV heads, head_dim 128)
   and smaller ones; fresh random data per case, shuffled page tables, NaN in every pool row
   the sequence does not own, outputs poisoned with NaN before each launch;
2. one CUDA graph replayed at several sequence lengths (the length lives in device memory);
3. the broken kernel under stress: many launches on fresh data, tail pages, how often it is
   wrong (in a subprocess with a time limit, in case the broken barrier hangs), and a sample of
   one wrong run (`broken_sample`: a few outputs of one head, broken next to fixed and numpy);
4. compute-sanitizer synccheck / racecheck / memcheck on small launches of both kernels;
5. timing: a device-to-device copy (the byte ceiling), decode attention per layer at 640, 8192
   and 32768 positions against the time to read that layer's K/V at copy bandwidth, and
   prefill attention of 512 tokens.

--quick runs what a change to the decode hand-off must pass and nothing else: section 1 for decode
only, on the 7B and small shapes at lengths with tail pages and stage reuse; section 3 with 20
runs per length; section 4 started first, running alongside (its 110 s limit bounds the run).
No timing. It writes attention-quick-<gpu>.md/.json instead, so a full report is never replaced
by a partial one.

Writes attention-<gpu>.md, attention-<gpu>.json (<gpu>: h100, h200) and the sanitizer logs to $OUT
(or results/).
Internal modes, run as subprocesses: --broken-stress, --sanitize {fixed,broken}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

from nanoqwen.reference import ops
from nanoqwen.config import PAGE_SIZE, ModelConfig
from nanoqwen.book.broken_attention import BrokenPagedAttention
from nanoqwen.cuda.attention import PagedAttention, random_paged_cache, relative_error
from nanoqwen.cuda.timing import gpu_ms
from nanoqwen.random_model import QWEN25_CODER_7B
from record import CUDA_SANITIZER, compute_sanitizer, gpu_tag, require_gpu


def shape(num_heads: int, num_kv_heads: int, head_dim: int, max_len: int = 32768) -> ModelConfig:
    q_dim = num_heads * head_dim
    hidden = max(128, -(-q_dim // 128) * 128)
    return ModelConfig(num_layers=1, hidden_size=hidden, intermediate_size=256, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=256,
                       max_position_embeddings=max_len, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True)


SHAPES = {
    "7B 28/4 D128": QWEN25_CODER_7B,
    "small 4/2 D64": shape(4, 2, 64),
    "tiny 4/2 D32": shape(4, 2, 32),
    "8/1 D96": shape(8, 1, 96),
    "MHA 2/2 D64": shape(2, 2, 64),
}
LENGTHS = (1, 15, 16, 17, 640, 4096, 32768)
SHORT_LENGTHS = (1, 17, 640, 4096)
# --quick: 72 and 325 are the sanitizer's lengths (a tail page; 21 pages wrap the 8 stages).
QUICK_SHAPES = ("7B 28/4 D128", "small 4/2 D64")
QUICK_LENGTHS = (1, 15, 17, 72, 325, 640, 4096)
QUICK_STRESS_RUNS = 20
QUICK_SANITIZER_S = 110
# broken_sample: the first wrong run of the broken kernel at these (shape, length) points, in order
# (lengths with a partly filled tail page), and how many of that head's outputs it keeps.
SAMPLE_POINTS = (("small 4/2 D64", 17), ("small 4/2 D64", 40), ("7B 28/4 D128", 4096))
SAMPLE_VALUES = 6
DECODE_TOL = 2e-3  # ||out - ref|| / ||ref||; fp16 output rounding alone is ~3e-4
PREFILL_TOL = 3e-3  # probabilities enter the tensor cores as fp16


def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or REPO / "results")
    path.mkdir(parents=True, exist_ok=True)
    return path


def log(*parts) -> None:
    print(*parts, flush=True)


# ------------------------------------------------------------------------ correctness


def decode_case(cp, attention, config, seq_len, rng, q_std=2.0):
    pool, table = random_paged_cache(config, seq_len, rng)
    q = (q_std * rng.standard_normal(config.q_dim)).astype(np.float32)
    ref = ops.paged_attention(q.reshape(1, config.num_heads, config.head_dim), pool, 0, table,
                                    np.array([seq_len - 1])).reshape(-1)
    table_d = cp.full(-(-attention.max_seq_len // PAGE_SIZE), -1, dtype=cp.int32)  # unused entries: garbage
    table_d[: len(table)] = cp.asarray(table)
    out = cp.full(config.q_dim, np.nan, dtype=cp.float16)
    attention.decode(cp.asarray(q), cp.asarray(pool[0]), table_d, cp.asarray(np.array([seq_len], np.int32)), out)
    return relative_error(out.get(), ref)


def prefill_case(cp, attention, config, start_pos, num_tokens, rng, check_rows=64):
    end = start_pos + num_tokens
    pool, table = random_paged_cache(config, end, rng)
    q = (2.0 * rng.standard_normal((num_tokens, config.q_dim))).astype(np.float32)
    out = cp.full((num_tokens, config.q_dim), np.nan, dtype=cp.float16)
    attention.prefill(cp.asarray(q), cp.asarray(pool[0]), cp.asarray(table), start_pos, num_tokens, out)
    out = out.get()
    if not np.all(np.isfinite(out)):  # every row, not only the ones compared below
        return float("inf")
    rows = np.arange(num_tokens)
    if num_tokens > check_rows:  # the oracle is O(T^2): compare the ends and a random middle
        middle = rng.choice(np.arange(8, num_tokens - 8), check_rows - 16, replace=False)
        rows = np.unique(np.concatenate([rows[:8], middle, rows[-8:]]))
    ref = ops.paged_attention(q[rows].reshape(len(rows), config.num_heads, config.head_dim), pool, 0, table,
                                    start_pos + rows)
    return relative_error(out[rows], ref.reshape(len(rows), -1))


def check_correctness(cp, results, quick: bool = False):
    """Every shape, decode and prefill; quick: decode only, QUICK_SHAPES at QUICK_LENGTHS."""
    rng = np.random.default_rng(2026)
    rows = []
    for name, config in SHAPES.items():
        if quick and name not in QUICK_SHAPES:
            continue
        lengths = QUICK_LENGTHS if quick else LENGTHS if name.startswith(("7B", "small")) else SHORT_LENGTHS
        max_len = max(lengths)
        full_grid = f"grid for {max_len // 1024}K"
        variants = {full_grid: PagedAttention(config, num_pages=2 * max_len // PAGE_SIZE, max_seq_len=max_len),
                    "1 split": PagedAttention(config, num_pages=2 * max_len // PAGE_SIZE, max_seq_len=max_len, splits=1),
                    "3 splits": PagedAttention(config, num_pages=2 * max_len // PAGE_SIZE, max_seq_len=max_len, splits=3)}
        main = variants[full_grid]
        for n in lengths:
            for vname, attention in variants.items():
                if vname != full_grid and n > 4096:
                    continue
                err = decode_case(cp, attention, config, n, rng)
                rows.append(dict(shape=name, kernel="decode", case=f"len {n}, {vname} ({attention.splits})", error=err,
                                 ok=err <= DECODE_TOL))
            if n <= 4096 and not quick:
                err = prefill_case(cp, main, config, 0, n, rng)
                rows.append(dict(shape=name, kernel="prefill", case=f"0 + {n} tokens", error=err, ok=err <= PREFILL_TOL))
        for start, count in () if quick else ((600, 40), (33, 1), (max_len - 512, 512)):
            err = prefill_case(cp, main, config, start, count, rng)
            rows.append(dict(shape=name, kernel="prefill", case=f"{start} + {count} tokens", error=err,
                             ok=err <= PREFILL_TOL))
        log(f"  {name}: {sum(r['ok'] for r in rows if r['shape'] == name)}/"
            f"{sum(r['shape'] == name for r in rows)} ok, worst "
            f"{max(r['error'] for r in rows if r['shape'] == name):.2e}")
    results["correctness"] = rows


def check_graph(cp, results):
    """Capture one decode launch, then replay it after changing only seq_len in device memory."""
    config = QWEN25_CODER_7B
    rng = np.random.default_rng(7)
    max_len = 4096
    attention = PagedAttention(config, num_pages=max_len // PAGE_SIZE + 3, max_seq_len=32768)
    pool, table = random_paged_cache(config, max_len, rng)
    kv = cp.asarray(pool[0])
    table_d = cp.full(32768 // PAGE_SIZE, -1, dtype=cp.int32)
    table_d[: len(table)] = cp.asarray(table)
    q = (2.0 * rng.standard_normal(config.q_dim)).astype(np.float32)
    q_d, seq_len = cp.asarray(q), cp.asarray(np.array([1], np.int32))
    out = cp.empty(config.q_dim, dtype=cp.float16)
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        attention.decode(q_d, kv, table_d, seq_len, out, stream=stream)
        graph = stream.end_capture()
    rows = []
    for n in (17, 1, 640, 4096, 33):
        with stream:  # the graph runs on `stream`: order the poison and the new length on it too
            seq_len.set(np.array([n], np.int32), stream=stream)
            out.fill(np.nan)
            graph.launch(stream)
        stream.synchronize()
        ref = ops.paged_attention(q.reshape(1, config.num_heads, config.head_dim), pool, 0, table,
                                        np.array([n - 1])).reshape(-1)
        err = relative_error(out.get(), ref)
        rows.append(dict(seq_len=n, error=err, ok=err <= DECODE_TOL))
    log("  graph replays: " + ", ".join(f"{r['seq_len']}: {r['error']:.1e}" for r in rows))
    results["graph"] = rows


# ------------------------------------------------------------------------ broken kernel


def wrong_run_sample(config, name, seq_len, run, kv, q, table, outs) -> dict:
    """One wrong run of the broken kernel, for the book: the head where it is furthest from the
    fixed kernel, its first SAMPLE_VALUES outputs from the broken kernel, the fixed one and the
    numpy oracle (on the same pool, query and page table, copied back)."""
    d = config.head_dim
    pages = -(-seq_len // PAGE_SIZE)
    pool = kv.get()[None]  # [1, P, 2, KVH, 16, D]
    ref = ops.paged_attention(q.get().reshape(1, config.num_heads, d), pool, 0, table.get()[:pages],
                              np.array([seq_len - 1])).reshape(config.num_heads, d)
    broken = outs[2].get().astype(np.float32).reshape(config.num_heads, d)
    fixed = outs[0].get().astype(np.float32).reshape(config.num_heads, d)
    gap = np.abs(np.nan_to_num(broken - fixed, nan=np.inf)).max(axis=1)
    head = int(np.argmax(gap))
    values = lambda x: [float(v) for v in x[head, :SAMPLE_VALUES]]  # noqa: E731
    return dict(shape=name, seq_len=seq_len, run=run, head=head, dims=list(range(SAMPLE_VALUES)),
                values_broken=values(broken), values_fixed=values(fixed), values_numpy=values(ref),
                error_broken=relative_error(broken, ref), error_fixed=relative_error(fixed, ref))


def broken_stress(cp, runs: int, sample: dict | None = None) -> list[dict]:
    """Fixed and broken decode on the same fresh data, `runs` times per length; the fixed
    kernel (checked against the oracle above) is the reference. A second fixed kernel with a
    different split count runs too: its disagreements would expose a race in the fixed one.
    `sample` (a dict) receives wrong_run_sample's record of the first wrong run at the first
    SAMPLE_POINTS entry that has one."""
    rows = []
    samples = {}
    for name in ("7B 28/4 D128", "small 4/2 D64"):
        config = SHAPES[name]
        max_len = 4096
        fixed = PagedAttention(config, num_pages=max_len // PAGE_SIZE + 8, max_seq_len=max_len)
        fixed_one = PagedAttention(config, num_pages=max_len // PAGE_SIZE + 8, max_seq_len=max_len, splits=1)
        broken = BrokenPagedAttention(config, num_pages=max_len // PAGE_SIZE + 8, max_seq_len=max_len)
        kv = cp.empty((max_len // PAGE_SIZE + 8, 2, config.num_kv_heads, PAGE_SIZE, config.head_dim), cp.float16)
        seq_len = cp.zeros(1, cp.int32)
        outs = [cp.empty(config.q_dim, cp.float16) for _ in range(3)]
        for n in (1, 9, 16, 17, 40, 129, 640, 4096):
            wrong = wrong_fixed = 0
            worst = 0.0
            for run in range(runs):
                kv[...] = cp.random.standard_normal(kv.shape, dtype=cp.float32).astype(cp.float16)
                q = 2.0 * cp.random.standard_normal(config.q_dim, dtype=cp.float32)
                table = cp.random.permutation(kv.shape[0]).astype(cp.int32)
                seq_len.fill(n)
                for out in outs:
                    out.fill(np.nan)
                fixed.decode(q, kv, table, seq_len, outs[0])
                fixed_one.decode(q, kv, table, seq_len, outs[1])
                broken.decode(q, kv, table, seq_len, outs[2])
                ref = outs[0].astype(cp.float32)
                scale = float(cp.linalg.norm(ref))
                err_b = float(cp.linalg.norm(outs[2].astype(cp.float32) - ref)) / scale
                err_f = float(cp.linalg.norm(outs[1].astype(cp.float32) - ref)) / scale
                err_b = err_b if np.isfinite(err_b) else float("inf")
                wrong += not err_b <= DECODE_TOL
                wrong_fixed += not err_f <= DECODE_TOL
                worst = max(worst, err_b)
                if not err_b <= DECODE_TOL and (name, n) in SAMPLE_POINTS and (name, n) not in samples:
                    samples[name, n] = wrong_run_sample(config, name, n, run, kv, q, table, outs)
            rows.append(dict(shape=name, seq_len=n, runs=runs, broken_wrong=wrong, fixed_disagree=wrong_fixed,
                             worst_broken_error=worst))
            log(f"  broken {name} len {n}: wrong {wrong}/{runs}, fixed splits disagree {wrong_fixed}/{runs}")
    if sample is not None:
        first = next((samples[point] for point in SAMPLE_POINTS if point in samples), None)
        if first is not None:
            sample.update(first)
    return rows


def run_sanitize(cp, which: str) -> None:
    """Small launches for compute-sanitizer: decode with a tail page and stage reuse, and
    (fixed only) prefill."""
    config = QWEN25_CODER_7B
    rng = np.random.default_rng(3)
    cls = BrokenPagedAttention if which == "broken" else PagedAttention
    for seq_len, splits in ((72, 2), (16 * 20 + 5, 1)):
        attention = cls(config, num_pages=64, max_seq_len=1024, splits=splits)
        err = decode_case(cp, attention, config, seq_len, rng)
        print(f"sanitize {which} decode len {seq_len} splits {splits}: error {err:.2e}", flush=True)
    if which == "fixed":
        err = prefill_case(cp, PagedAttention(config, num_pages=64, max_seq_len=1024), config, 3, 37, rng)
        print(f"sanitize fixed prefill 3 + 37: error {err:.2e}", flush=True)
    cp.cuda.Device().synchronize()


SANITIZER_PROCESSES: list[subprocess.Popen] = []  # ended by hung() if the run stops early


def start_sanitizers() -> list[tuple]:
    """Each tool on each kernel, all at once in subprocesses; returns what collect_sanitizers needs."""
    scratch = Path(tempfile.mkdtemp())
    sanitizer = compute_sanitizer() or CUDA_SANITIZER  # a missing one fails in each job's log
    jobs = []
    for which, tools in (("broken", ("synccheck", "racecheck")), ("fixed", ("synccheck", "racecheck", "memcheck"))):
        for tool in tools:
            logfile = scratch / f"sanitizer-{tool}-{which}.txt"
            cmd = [sanitizer, "--tool", tool, "--print-limit", "40", sys.executable, __file__,
                   "--sanitize", which]
            # A session of its own, so ending it ends the sanitizer and the process it started.
            proc = subprocess.Popen(cmd, stdout=logfile.open("w"), stderr=subprocess.STDOUT, cwd=REPO,
                                    start_new_session=True)
            SANITIZER_PROCESSES.append(proc)
            jobs.append((which, tool, logfile, proc))
    return jobs


def end_session(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def sanitizer_runs(results, folder: Path):
    """Start the sanitizer runs and collect them, 120 s at most."""
    collect_sanitizers(start_sanitizers(), results, folder, deadline=time.time() + 120)


def collect_sanitizers(jobs: list[tuple], results, folder: Path, deadline: float):
    """Wait for the runs until `deadline` (then end them); their logs end up concatenated in
    `folder`/sanitizer-logs.txt."""
    rows = []
    for which, tool, logfile, proc in jobs:
        try:
            proc.wait(timeout=max(1, deadline - time.time()))
            status = proc.returncode
        except subprocess.TimeoutExpired:
            end_session(proc)
            status = "timeout"
        text = logfile.read_text(errors="replace")
        summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line or "RACECHECK SUMMARY" in line]
        excerpt = [line for line in text.splitlines() if line.startswith("=========")][:24]
        rows.append(dict(kernel=which, tool=tool, status=status, summary=summary[-1] if summary else "(none)",
                         excerpt=excerpt))
        log(f"  {tool} {which}: {rows[-1]['summary']} (exit {status})")
        with (folder / "sanitizer-logs.txt").open("a") as bundle:
            bundle.write(f"\n######## compute-sanitizer --tool {tool}, {which} kernel (exit {status})\n{text}")
        logfile.unlink()
    results["sanitizer"] = rows
    if jobs:
        jobs[0][2].parent.rmdir()  # start_sanitizers' folder, now empty


# ------------------------------------------------------------------------ timing


def time_graph(cp, launch, count: int, replays: int = 15) -> float:
    """Median milliseconds per launch: `count` launches captured in one graph, replayed."""
    cp.cuda.Device().synchronize()  # the inputs were made on the default stream; ours does not wait for it
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        launch(0, stream)  # warm-up outside the capture
        stream.synchronize()
        stream.begin_capture()
        for i in range(count):
            launch(i, stream)
        graph = stream.end_capture()
    return gpu_ms(stream, lambda: graph.launch(stream), replays) / count


def copy_bandwidth(cp) -> dict:
    nbytes = 2 << 30
    a = cp.random.random(nbytes // 4, dtype=cp.float32)
    b = cp.empty_like(a)
    stream = cp.cuda.get_current_stream()
    ms = gpu_ms(stream, lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes,
                                                           cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr),
                repeats=10, warmup=2)
    return dict(bytes_moved=2 * nbytes, ms=ms, tb_per_s=2 * nbytes / ms / 1e9)


def time_decode(cp, results, bandwidth):
    config = QWEN25_CODER_7B
    rows = []
    for n in (640, 8192, 32768):
        attention = PagedAttention(config, num_pages=32768 // PAGE_SIZE, max_seq_len=32768)
        variants = [("default", attention)]
        if n >= 8192:  # is the grid (2 blocks per SM) the right size? try half and twice the splits
            for label, splits in (("half splits", attention.splits // 2), ("2x splits", 2 * attention.splits)):
                variants.append((label, PagedAttention(config, num_pages=32768 // PAGE_SIZE, max_seq_len=32768,
                                                       splits=splits)))
        layer_bytes = attention.decode_kv_bytes(n)
        rotations = max(4, -(-(512 << 20) // layer_bytes))  # > 8x the 60 MB L2: every launch reads from HBM
        pages = -(-n // PAGE_SIZE)
        kv = cp.random.standard_normal((pages * rotations, 2, config.num_kv_heads, PAGE_SIZE, config.head_dim),
                                       dtype=cp.float32).astype(cp.float16)
        tables = cp.random.permutation(pages * rotations).astype(cp.int32).reshape(rotations, pages)
        tables = cp.ascontiguousarray(cp.pad(tables, ((0, 0), (0, 32768 // PAGE_SIZE - pages))))
        q = cp.random.standard_normal(config.q_dim, dtype=cp.float32)
        out = cp.empty(config.q_dim, cp.float16)
        seq_len = cp.asarray(np.array([n], np.int32))
        for vname, att in variants:
            ms = time_graph(cp, lambda i, s, att=att: att.decode(q, kv, tables[i % rotations], seq_len, out, stream=s),
                            count=min(200, 4 * rotations))
            floor_ms = layer_bytes / (bandwidth["tb_per_s"] * 1e9)
            rows.append(dict(seq_len=n, variant=vname, splits=att.splits, us=ms * 1e3, kv_bytes=layer_bytes,
                             floor_us=floor_ms * 1e3, fraction_of_copy_bw=floor_ms / ms))
            log(f"  decode {n} ({vname}, {att.splits} splits): {ms * 1e3:.2f} us/layer, floor {floor_ms * 1e3:.2f} us "
                f"({floor_ms / ms:.0%} of copy bandwidth)")
    results["decode_timing"] = rows


def time_prefill(cp, results):
    config = QWEN25_CODER_7B
    n = 512
    attention = PagedAttention(config, num_pages=4096, max_seq_len=32768)
    pages = n // PAGE_SIZE
    rotations = 8
    kv = cp.random.standard_normal((pages * rotations, 2, config.num_kv_heads, PAGE_SIZE, config.head_dim),
                                   dtype=cp.float32).astype(cp.float16)
    tables = cp.random.permutation(pages * rotations).astype(cp.int32).reshape(rotations, pages)
    q = cp.random.standard_normal((n, config.q_dim), dtype=cp.float32)
    out = cp.empty((n, config.q_dim), cp.float16)
    ms = time_graph(cp, lambda i, s: attention.prefill(q, kv, tables[i % rotations], 0, n, out), count=40)
    flops = attention.prefill_flops(0, n)
    row = dict(tokens=n, us_per_layer=ms * 1e3, ms_28_layers=28 * ms, tflops=flops / ms / 1e9)
    log(f"  prefill {n}: {ms * 1e3:.1f} us/layer, {28 * ms:.2f} ms for 28 layers, {row['tflops']:.1f} TFLOP/s")
    results["prefill_timing"] = row


# ------------------------------------------------------------------------ report


def write_report(results, folder: Path, stem: str, command: str):
    bw = results.get("bandwidth", {})
    lines = [
        "# Paged attention on the H200",
        "",
        f"- date: {results['date']}",
        f"- GPU: {results.get('gpu', '?')}, driver/runtime {results.get('cuda', '?')}, CuPy {results.get('cupy', '?')}",
        f"- command: `{command}`",
        "- kernels: kernels/paged_attention.cu (decode: 1 producer + 4 consumer warps, 8 stages, then a combine kernel; prefill: mma.sync), "
        "kernels/paged_attention_broken.cu",
        "",
    ]
    if bw:  # --quick measures no bandwidth: no section
        lines += [
            "## Byte floor",
            "",
            f"Device-to-device copy of {bw['bytes_moved'] / 2**30:.0f} GiB (read + write counted): "
            f"{bw['ms']:.3f} ms, **{bw['tb_per_s']:.2f} TB/s**. The floor of one decode attention call is "
            "the layer's K and V bytes (seq_len x 2 x KVH x D x 2 B = 2 KiB per position at the 7B's shape) "
            "read at that rate.",
            "",
        ]
    if "decode_timing" in results:
        lines += ["## Decode attention, Qwen2.5-Coder-7B shape (28 query heads, 4 KV heads, D 128), one layer", "",
                  "CUDA graph of launches rotating over enough page tables that K/V comes from HBM, not L2.", "",
                  "| positions | grid | K/V bytes | time (us) | floor (us) | fraction of copy bandwidth |",
                  "| ---: | --- | ---: | ---: | ---: | ---: |"]
        for r in results["decode_timing"]:
            lines.append(f"| {r['seq_len']} | {r['variant']}, {r['splits']} splits x 4 | {r['kv_bytes'] / 2**20:.2f} MiB "
                         f"| {r['us']:.2f} | {r['floor_us']:.2f} | {r['fraction_of_copy_bw']:.0%} |")
        lines.append("")
    if "prefill_timing" in results:
        r = results["prefill_timing"]
        lines += ["## Prefill attention, 7B shape", "",
                  f"{r['tokens']} tokens from position 0: **{r['us_per_layer']:.1f} us per layer**, "
                  f"{r['ms_28_layers']:.2f} ms for all 28 layers ({r['tflops']:.1f} TFLOP/s counting 4 x heads x D "
                  "x visible pairs).", ""]
    if "correctness" in results:
        rows = results["correctness"]
        lines += ["## Correctness against nanoqwen.reference.ops.paged_attention", "",
                  f"{sum(r['ok'] for r in rows)}/{len(rows)} cases pass (decode tolerance {DECODE_TOL}, prefill "
                  f"{PREFILL_TOL}, relative L2 error; NaN in every unowned pool row, outputs poisoned with NaN).", "",
                  "| shape | kernel | case | relative error | ok |", "| --- | --- | --- | ---: | --- |"]
        for r in rows:
            lines.append(f"| {r['shape']} | {r['kernel']} | {r['case']} | {r['error']:.2e} | {'yes' if r['ok'] else 'NO'} |")
        lines.append("")
    if "graph" in results:
        lines += ["## One CUDA graph, many lengths", "",
                  "One decode launch captured at seq_len 1, replayed after writing another length into device memory: "
                  + ", ".join(f"{r['seq_len']}: {r['error']:.1e}" for r in results["graph"]), ""]
    if "broken_stress" in results:
        lines += ["## The broken kernel under stress", "",
                  "Fixed and broken decode on the same fresh random data each run (7B grid for 4096 positions). "
                  "'wrong' = relative error above the tolerance against the fixed kernel; the last column compares "
                  "the fixed kernel with a 1-split fixed kernel on the same data.", "",
                  "| shape | positions | runs | broken wrong | worst broken error | fixed disagreements |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in results["broken_stress"]:
            lines.append(f"| {r['shape']} | {r['seq_len']} | {r['runs']} | {r['broken_wrong']} | "
                         f"{r['worst_broken_error']:.2e} | {r['fixed_disagree']} |")
        lines.append("")
    if "broken_sample" in results:
        r = results["broken_sample"]
        lines += [f"One wrong run of the broken kernel ({r['shape']}, {r['seq_len']} positions, run {r['run']}, "
                  f"query head {r['head']}; relative error against numpy: broken {r['error_broken']:.2e}, "
                  f"fixed {r['error_fixed']:.2e}):", "",
                  "| dim | broken | fixed | numpy |", "| ---: | ---: | ---: | ---: |"]
        for dim, b, f, n in zip(r["dims"], r["values_broken"], r["values_fixed"], r["values_numpy"]):
            lines.append(f"| {dim} | {b:.4f} | {f:.4f} | {n:.4f} |")
        lines.append("")
    if "sanitizer" in results:
        lines += ["## compute-sanitizer", "", "| kernel | tool | summary | exit |", "| --- | --- | --- | --- |"]
        for r in results["sanitizer"]:
            lines.append(f"| {r['kernel']} | {r['tool']} | {r['summary']} | {r['status']} |")
        lines.append("")
        for r in results["sanitizer"]:
            if r["kernel"] == "broken":
                lines += [f"Excerpt, {r['tool']} on the broken kernel:", "", "```text", *r["excerpt"], "```", ""]
    if results.get("failures"):
        lines += ["## Sections that failed", "", "```text", *results["failures"], "```", ""]
    lines += ["## Machine-readable summary (read by chapter 5)", "", "```json",
              json.dumps(machine_summary([results]), indent=1, default=str), "```", ""]
    (folder / f"{stem}.md").write_text("\n".join(lines))


def machine_summary(runs: list[dict]) -> dict:
    """The figures chapter 5 plots, from one or more runs of this script (the last one's
    timings; every run's broken-kernel counts)."""
    last = runs[-1]
    summary = dict(date=last["date"], gpu=last["gpu"])
    if "bandwidth" in last:
        summary["copy_tb_per_s"] = last["bandwidth"]["tb_per_s"]
    if "decode_timing" in last:
        summary["decode"] = [{k: r[k] for k in ("seq_len", "variant", "splits", "us", "floor_us", "kv_bytes")}
                             for r in last["decode_timing"]]
    if "prefill_timing" in last:
        summary["prefill_512_us_per_layer"] = last["prefill_timing"]["us_per_layer"]
        summary["prefill_tflops"] = last["prefill_timing"]["tflops"]
    if "correctness" in last:
        rows = last["correctness"]
        summary.update(correctness_pass=sum(r["ok"] for r in rows), correctness_cases=len(rows),
                       worst_error=max(r["error"] for r in rows))
    stress = [run["broken_stress"] for run in runs if "broken_stress" in run]
    if stress:
        summary["broken_stress"] = [
            dict(shape=rows[0]["shape"], seq_len=rows[0]["seq_len"], runs_each=rows[0]["runs"],
                 wrong=[r["broken_wrong"] for r in rows], fixed_disagree=sum(r["fixed_disagree"] for r in rows))
            for rows in zip(*stress)
        ]
    if "sanitizer" in last:
        summary["sanitizer"] = [{k: r[k] for k in ("kernel", "tool", "summary")} for r in last["sanitizer"]]
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broken-stress", type=int, metavar="RUNS")
    parser.add_argument("--sanitize", choices=("fixed", "broken"))
    parser.add_argument("--skip", nargs="*", default=[], help="sections to skip")
    parser.add_argument("--quick", action="store_true",
                        help="decode correctness, a short broken-kernel stress and the sanitizers alongside (~2 min)")
    parser.add_argument("--scratch", default=None, help="where subprocesses leave their files")
    args = parser.parse_args()
    require_gpu("gpu_check_attention")
    import cupy as cp

    if args.sanitize:
        run_sanitize(cp, args.sanitize)
        return
    folder = out_dir()
    if args.broken_stress:
        sample = {}
        Path(args.scratch, "broken-stress.json").write_text(json.dumps(broken_stress(cp, args.broken_stress, sample)))
        if sample:
            Path(args.scratch, "broken-sample.json").write_text(json.dumps(sample))
        return

    props = cp.cuda.runtime.getDeviceProperties(0)
    results = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        gpu=f"{props['name'].decode()} ({props['multiProcessorCount']} SMs)",
        cuda=f"{cp.cuda.runtime.driverGetVersion()}/{cp.cuda.runtime.runtimeGetVersion()}",
        cupy=cp.__version__,
        failures=[],
    )
    # (name, work, seconds after which a hung kernel is assumed and the run ends with what it has)
    if args.quick:
        pending, deadline = start_sanitizers(), time.time() + QUICK_SANITIZER_S
        sections = [
            ("correctness", lambda: check_correctness(cp, results, quick=True), 90),  # shares the GPU with the sanitizers
            ("broken_stress", lambda: stress_subprocess(results, QUICK_STRESS_RUNS, timeout=50), 60),
            ("sanitizer", lambda: collect_sanitizers(pending, results, folder, deadline), QUICK_SANITIZER_S + 10),
        ]
        stem, command = f"attention-quick-{gpu_tag()}", "python3 tools/gpu_check_attention.py --quick"
    else:
        sections = [
            ("correctness", lambda: check_correctness(cp, results), 120),
            ("graph", lambda: check_graph(cp, results), 30),
            ("bandwidth", lambda: results.__setitem__("bandwidth", copy_bandwidth(cp)), 30),
            ("decode_timing", lambda: time_decode(cp, results, results["bandwidth"]), 60),
            ("prefill_timing", lambda: time_prefill(cp, results), 30),
            ("broken_stress", lambda: stress_subprocess(results), 130),
            ("sanitizer", lambda: sanitizer_runs(results, folder), 130),
        ]
        stem, command = f"attention-{gpu_tag()}", "python3 tools/gpu_check_attention.py"
    finish = lambda: finish_run(results, folder, stem, command)  # noqa: E731
    for name, section, limit in sections:
        if name in args.skip:
            continue
        log(f"== {name}")
        started = time.time()
        watchdog = threading.Timer(limit, hung, (results, name, limit, finish))
        watchdog.daemon = True
        watchdog.start()
        try:
            section()
        except Exception:
            results["failures"].append(f"{name}: {traceback.format_exc()}")
            log(traceback.format_exc())
        watchdog.cancel()
        log(f"   ({time.time() - started:.1f} s)")
        cp.get_default_memory_pool().free_all_blocks()
    finish()


def hung(results, name, limit, finish):
    results["failures"].append(f"{name}: still running after {limit} s (a hung kernel?); run ended here")
    for proc in SANITIZER_PROCESSES:
        if proc.poll() is None:
            end_session(proc)
    finish()
    os._exit(3)


def finish_run(results, folder: Path, stem: str, command: str):
    (folder / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    write_report(results, folder, stem, command)
    print_summary(results)


def print_summary(results):
    """A short table last, so it survives the end of a long log."""
    print("\n==== summary", results["gpu"], results["date"])
    if "correctness" in results:
        rows = results["correctness"]
        bad = [r for r in rows if not r["ok"]]
        print(f"correctness: {len(rows) - len(bad)}/{len(rows)} ok; worst {max(r['error'] for r in rows):.2e}")
        for r in bad[:12]:
            print("   FAIL", r)
    if "graph" in results:
        print("graph:", all(r["ok"] for r in results["graph"]))
    if "bandwidth" in results:
        print(f"copy: {results['bandwidth']['tb_per_s']:.2f} TB/s")
    for r in results.get("decode_timing", []):
        print(f"decode {r['seq_len']:>6} {r['variant']:<17} {r['us']:8.2f} us  floor {r['floor_us']:7.2f} us  "
              f"{r['fraction_of_copy_bw']:.0%}")
    if "prefill_timing" in results:
        r = results["prefill_timing"]
        print(f"prefill 512: {r['us_per_layer']:.1f} us/layer, {r['tflops']:.1f} TFLOP/s")
    for r in results.get("broken_stress", []):
        print(f"broken {r['shape']:<14} len {r['seq_len']:>5}: wrong {r['broken_wrong']}/{r['runs']}, "
              f"fixed disagree {r['fixed_disagree']}")
    for r in results.get("sanitizer", []):
        print(f"sanitizer {r['tool']:<10} {r['kernel']:<7} {r['summary']} exit {r['status']}")
    for f in results.get("failures", []):
        print("FAILED SECTION:", f.splitlines()[0], f.splitlines()[-1])


def stress_subprocess(results, runs: int = 200, timeout: int = 120):
    """The broken kernel runs in its own process: if its barrier hangs the GPU work, only that
    process is killed."""
    with tempfile.TemporaryDirectory() as scratch:
        cmd = [sys.executable, __file__, "--broken-stress", str(runs), "--scratch", scratch]
        try:
            proc = subprocess.run(cmd, cwd=REPO, timeout=timeout, capture_output=True, text=True)
            print(proc.stdout[-4000:], proc.stderr[-4000:], flush=True)
            results["broken_stress"] = json.loads(Path(scratch, "broken-stress.json").read_text())
            if Path(scratch, "broken-sample.json").exists():
                results["broken_sample"] = json.loads(Path(scratch, "broken-sample.json").read_text())
        except subprocess.TimeoutExpired:
            results["failures"].append(f"broken_stress: timed out after {timeout} s (the broken kernel hung?)")


if __name__ == "__main__":
    main()
