"""Where each block of the decode step's kernels ran, and when, inside the step itself.

tools/step_timeline.py times each kernel by its block 0. This builds the kernels with
-DNQ_TRACE_BLOCKS (kernels/common.cuh) instead: every block of the GEMVs, attention and its combine
records the SM it ran on, when it started, when its programmatic-dependent-launch wait returned and
when it finished. Per kernel, over every layer of a few steps: how many SMs its blocks used and the
most one SM held, how long before its first wait returned its first block started (its head
start), and when its median and last blocks finished after that wait. A kernel's blocks land
wherever an SM has room for them while the kernel in front still runs, so the SMs used say where
that room was.

    python3 -m nanoqwen.random_model /tmp/q14b.nanoqwen --preset qwen2.5-coder-14b
    python3 tools/block_trace.py /tmp/q14b.nanoqwen --context 576

Each block keeps two moments in 16 bytes of shared memory until it finishes, so a kernel whose
blocks fill an SM's shared memory to the last bytes may fit one block fewer than in the engine's
step: compare the traced step printed here with `nanoqwen bench`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from nanoqwen.cuda.abi import kernel_int
from nanoqwen.cuda.plan import GEMV_KERNELS, QKV_ROPE_KERNEL
from nanoqwen.cuda.profile import STEP_PROMPT_TOKENS, TIMING_STEPS, step_timing_record
from nanoqwen.loader import load
from record import output_path, require_gpu
from step_timeline import LABELS, traced_backend

# kernels/common.cuh's TRACED_* number of each kernel that records its blocks
TRACED = {kernel_int("common.cuh", f"TRACED_{suffix}"): name for suffix, name in (
    ("QKV_ROPE", QKV_ROPE_KERNEL), ("FROM_HIDDEN", GEMV_KERNELS["qkv"]), ("ATTENTION", "paged_attention_decode"),
    ("COMBINE", "paged_attention_combine"), ("FROM_Q_DIM", GEMV_KERNELS["o"]), ("GATE_UP", "gemv_int4_gate_up_silu"),
    ("FROM_INTERMEDIATE", GEMV_KERNELS["down"]))}
RECORD_WORDS = kernel_int("common.cuh", "BLOCK_RECORD_WORDS")  # kernel | SM, started, wait returned, finished
KERNEL_SHIFT = kernel_int("common.cuh", "BLOCK_RECORD_KERNEL_SHIFT")
RECORDS_PER_MODULE = 1 << 18  # a step of the 32B records about 180,000 blocks of its GEMVs


def decode_records(words: np.ndarray) -> dict[str, np.ndarray]:
    """Block records (uint64 [n, RECORD_WORDS], as trace_block_done writes them) as columns: kernel number,
    SM, and the three moments in ns."""
    key = words[:, 0].astype(np.uint64)
    return {"kernel": (key >> np.uint64(KERNEL_SHIFT)).astype(np.int64),
            "sm": (key & np.uint64((1 << KERNEL_SHIFT) - 1)).astype(np.int64),
            "started": words[:, 1].astype(np.int64), "waited": words[:, 2].astype(np.int64),
            "finished": words[:, 3].astype(np.int64)}


def launches(records: dict[str, np.ndarray], kernel: int, per_step: int) -> list[np.ndarray]:
    """The indices of `kernel`'s records in each of its `per_step` launches of one step. A launch
    begins only after every block of the one before it has started, so in the order blocks started
    the launches follow each other; each holds the same number of blocks (every layer's launch has
    the same work)."""
    mine = np.flatnonzero(records["kernel"] == kernel)
    if len(mine) % per_step:
        raise RuntimeError(f"{len(mine)} blocks of kernel {TRACED[kernel]} do not split into {per_step} equal launches")
    mine = mine[np.argsort(records["started"][mine], kind="stable")]
    return np.split(mine, per_step)


def summarize_blocks(steps: list[dict[str, np.ndarray]], per_step: int) -> list[dict]:
    """Per traced kernel, in step order, means over every launch of every step (µs from the
    launch's first wait return): blocks, SMs used, head start, median and last block finished; and
    the most blocks one SM held in any launch."""
    rows = {}
    for records in steps:
        order = sorted(set(records["kernel"].tolist()), key=lambda k: records["started"][records["kernel"] == k].min())
        for kernel in order:
            row = rows.setdefault(kernel, {"blocks": [], "sms": [], "most_on_one_sm": 0, "head_start_us": [],
                                           "median_finished_us": [], "last_finished_us": []})
            for launch in launches(records, kernel, per_step):
                first_wait = records["waited"][launch].min()
                finished = records["finished"][launch] - first_wait
                sms = Counter(records["sm"][launch].tolist())
                row["blocks"].append(len(launch))
                row["sms"].append(len(sms))
                row["most_on_one_sm"] = max(row["most_on_one_sm"], max(sms.values()))
                row["head_start_us"].append((first_wait - records["started"][launch].min()) / 1e3)
                row["median_finished_us"].append(float(np.median(finished)) / 1e3)
                row["last_finished_us"].append(float(finished.max()) / 1e3)
    return [{"kernel": TRACED[kernel], "label": LABELS.get(TRACED[kernel], TRACED[kernel]),
             "most_on_one_sm": row.pop("most_on_one_sm"), **{name: float(np.mean(v)) for name, v in row.items()}}
            for kernel, row in rows.items()]


def record_block_steps(backend, page_table, prompt_tokens: int, modules, steps: int):
    """Replays the decode graph `steps` times from the end of a prompt of `prompt_tokens`; returns
    each step's block records (decode_records) and its GPU-event time in ms."""
    import cupy as cp

    from nanoqwen.cuda.timing import gpu_times_ms

    traced = []  # (module's counter, its share of the records)
    words = cp.zeros((len(modules), RECORDS_PER_MODULE, RECORD_WORDS), dtype=cp.uint64)
    for m, module in enumerate(modules):
        try:
            count = cp.ndarray((1,), cp.uint32, memptr=module.get_global("nq_block_count"))
        except Exception:  # noqa: BLE001 - a module without kernels/common.cuh's block records
            continue
        cp.ndarray((1,), cp.uint64, memptr=module.get_global("nq_block_records"))[...] = words[m].data.ptr
        cp.ndarray((1,), cp.uint32, memptr=module.get_global("nq_block_capacity"))[...] = RECORDS_PER_MODULE
        traced.append((count, m))
    graph = backend.decode_graph()
    backend.set_step_inputs(1, prompt_tokens, page_table)
    gpu_times_ms(backend.stream, graph.launch, 2, warmup=0)  # the graph's first replays, not recorded
    steps_records, step_ms = [], []
    for _ in range(steps):
        for count, _ in traced:
            count.fill(0)
        cp.cuda.Device().synchronize()  # the counters are zeroed on CuPy's stream, not the step's
        step_ms += gpu_times_ms(backend.stream, graph.launch, 1, warmup=0)
        counts = [int(count.get()[0]) for count, _ in traced]
        if max(counts) > RECORDS_PER_MODULE:
            raise RuntimeError(f"a module recorded {max(counts)} blocks, room for {RECORDS_PER_MODULE}")
        host = words.get()
        steps_records.append(decode_records(np.concatenate([host[m, :n] for (_, m), n in zip(traced, counts)])))
    return steps_records, step_ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .nanoqwen file of any size (random weights of a published shape: nanoqwen.random_model)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--context", type=int, default=STEP_PROMPT_TOKENS,
                        help="tokens of the random prompt the traced steps follow (default %(default)s)")
    parser.add_argument("--json", type=output_path, help="write the rows, with where and when they were measured, here")
    args = parser.parse_args(argv)
    if not 1 <= args.steps <= TIMING_STEPS - 2:  # the prompt's pages hold TIMING_STEPS more tokens, two for warm-up
        parser.error(f"--steps must be 1 to {TIMING_STEPS - 2}, got {args.steps}")
    require_gpu("block_trace")

    import cupy as cp

    model = load(args.model)
    backend, page_table, modules = traced_backend(model, args.context, define="NQ_TRACE_BLOCKS")
    steps, step_ms = record_block_steps(backend, page_table, args.context, modules, args.steps)
    rows = summarize_blocks(steps, model.config.num_layers)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    print(f"traced step {np.median(step_ms) * 1e3:.1f} us (median of {args.steps}); {sms} SMs; "
          f"times from each launch's first wait return")
    print(f"{'kernel':22s} {'blocks':>6s} {'SMs':>6s} {'most/SM':>7s} {'head start':>10s} {'median done':>11s} {'last done':>9s}")
    for r in rows:
        print(f"{r['label']:22s} {r['blocks']:6.0f} {r['sms']:6.1f} {r['most_on_one_sm']:7d} {r['head_start_us']:10.2f} "
              f"{r['median_finished_us']:11.2f} {r['last_finished_us']:9.2f}")
    if args.json:
        record = step_timing_record("tools/block_trace.py", argv or sys.argv[1:], rows, args.context, steps=1)
        record.update(steps=args.steps, sms=sms, step_ms=step_ms)
        args.json.write_text(json.dumps(record, indent=1))
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
