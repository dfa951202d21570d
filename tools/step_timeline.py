"""Where the decode step's time goes, kernel by kernel, measured inside the step itself.

`nanoqwen bench` times each kernel in a graph of its own launches, which does not say when,
inside the real step, each kernel could begin its work. This compiles the kernels with -DNQ_TRACE (kernels/common.cuh):
thread 0 of block 0 of every kernel records the GPU's global clock when the kernel starts and
when its programmatic-dependent-launch wait returns, i.e. when the kernel in front has finished
and its writes are visible. The time from one kernel's wait returning to the next one's is the
first kernel's share of the step: its work after its inputs were ready, plus the hand-off to the
next. Those shares add up to the step, less the first kernel's head start (the last kernel's
runs to the end of the step, timed with the step's GPU events). How long before its wait a
kernel started is its head start: what the prologue above the wait (a GEMV's first weights,
attention's barriers) could overlap.

    python3 -m nanoqwen.random_model /tmp/q7b.nanoqwen --preset qwen2.5-coder-7b
    python3 tools/step_timeline.py /tmp/q7b.nanoqwen --json results/step-timeline-h200.json
    python3 tools/step_timeline.py /tmp/q7b.nanoqwen --context 4096     # the steps after 4K tokens

The records cost each kernel two atomics and two stores in one thread, about 0.3 µs per launch
on an H200: compare the traced step printed here with `nanoqwen bench`'s graph step.

That is the step with a kernel per operation. The persistent kernel (kernels/decode_persistent.cu),
one launch for every layer, records inside itself instead: thread 0 of every block, for each
operation of each layer it takes part in, when it began (its first weights requested), when its
wait returned and when it finished. An operation's share of the step runs from the last block's
finish of the operation before it to its own last block's finish; its hand-off is from that first
moment to the first block whose wait returned.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from nanoqwen.cuda import build
from nanoqwen.byte_floor import bytes_per_token, kernel_bytes
from nanoqwen.cuda.persistent import persistent_refusal
from nanoqwen.cuda.plan import GEMV_KERNELS, QKV_ROPE_KERNEL
from nanoqwen.cuda.profile import STEP_PROMPT_TOKENS
from nanoqwen.cuda.profile import TIMING_STEPS, prompted_backend, step_launch_names, step_timing_record
from nanoqwen.cuda.timing import gpu_times_ms
from nanoqwen.loader import load
from record import output_path, require_gpu

LABELS = {"gemv_int4_gate_up_silu": "gate+up GEMV", GEMV_KERNELS["down"]: "down GEMV", GEMV_KERNELS["qkv"]: "q|k|v GEMV",
          QKV_ROPE_KERNEL: "q|k|v GEMV + RoPE",
          GEMV_KERNELS["o"]: "o GEMV", "paged_attention_decode": "attention (split)", "paged_attention_combine":
          "attention (combine)", "add_rmsnorm_cluster": "add_rmsnorm", "rope_write_kv": "rope_write_kv",
          "lm_head_logits": "lm_head", "argmax_select_next": "argmax", "embed_tokens": "embed_tokens"}


def traced_backend(model, prompt_tokens: int, define: str = "NQ_TRACE"):
    """A CudaBackend holding a prompt of `prompt_tokens` tokens, its kernel modules compiled with
    `define` (NQ_TRACE, or tools/block_trace.py's NQ_TRACE_BLOCKS); returns (backend, page_table, modules)."""
    modules, compile_module = [], build.compile_module

    def compile_traced(config, files=build.DECODER_KERNEL_FILES, extra_defines=None):
        module = compile_module(config, files, {**(extra_defines or {}), define: "1"})
        modules.append(module)
        return module

    build.compile_module = compile_traced
    try:
        backend, page_table = prompted_backend(model, prompt_tokens)
    finally:
        build.compile_module = compile_module
    return backend, page_table, modules


def point_modules_at(modules, starts, releases, counters) -> None:
    """Every traced module records into `starts` and `releases` (uint64 [capacity]), counting in
    `counters` (uint32 [2])."""
    import cupy as cp

    for module in modules:
        for name, array in (("nq_trace_starts", starts), ("nq_trace_releases", releases),
                            ("nq_trace_counters", counters)):
            cp.ndarray((1,), cp.uint64, memptr=module.get_global(name))[...] = array.data.ptr
        cp.ndarray((1,), cp.uint32, memptr=module.get_global("nq_trace_capacity"))[...] = starts.size
    cp.cuda.Device().synchronize()


def record_steps(backend, page_table, prompt_tokens: int, modules, launches: int, steps: int):
    """Replays the decode graph `steps` times from the end of a prompt of `prompt_tokens`; returns (start, wait
    returned) in ns, each [steps, launches], and the GPU-event time of every step in ns."""
    import cupy as cp

    starts, releases = (cp.zeros(steps * launches, dtype=cp.uint64) for _ in range(2))
    counters = cp.zeros(2, dtype=cp.uint32)
    graph = backend.decode_graph()
    point_modules_at(modules, starts, releases, counters)
    backend.set_step_inputs(1, prompt_tokens, page_table)
    stream, step_ns = backend.stream, []
    cp.cuda.Device().synchronize()
    counters.fill(0)
    cp.cuda.Device().synchronize()
    step_ns += [ms * 1e6 for ms in gpu_times_ms(stream, graph.launch, steps, warmup=0)]
    taken = counters.get().tolist()
    if taken != [steps * launches] * 2:
        raise RuntimeError(f"{taken} starts and wait returns recorded, expected {steps} steps x {launches} launches")
    start = starts.get().astype(np.int64).reshape(steps, launches)
    released = releases.get().astype(np.int64).reshape(steps, launches)
    if (np.diff(released, axis=1) < 0).any():
        raise RuntimeError("a kernel's wait returned before the one in front's: the records are out of launch order")
    return start, released, np.array(step_ns)


def summarize(config, names: list[str], start, released, step_ns, bandwidth: float,
              prompt_tokens: int = STEP_PROMPT_TOKENS) -> dict:
    """Per kernel: its mean share of the step (from its wait returning to the next kernel's) and
    head start (from its start to its wait returning), in µs, over every step and launch."""
    shares = np.empty_like(released)
    shares[:, :-1] = np.diff(released, axis=1)
    # The last launch's share runs to the step's end: the step's GPU events began just before its
    # first kernel started, so start + the events' time is the end, a little late.
    shares[:, -1] = start[:, 0] + step_ns.astype(np.int64) - released[:, -1]
    head_starts = released - start
    per_kernel = defaultdict(lambda: {"launches_per_step": 0, "share_us": [], "head_start_us": []})
    for k, name in enumerate(names):
        entry = per_kernel[name]
        entry["launches_per_step"] += 1
        entry["share_us"].extend((shares[:, k] / 1e3).tolist())
        entry["head_start_us"].extend((head_starts[:, k] / 1e3).tolist())
    # the timed step reads the prompt's positions and its own; RoPE has a launch of its own only where the q|k|v GEMV does not do it
    floor_bytes = kernel_bytes(config, prompt_tokens + 1, rope_in_qkv="rope_write_kv" not in names)
    floor_bytes["paged_attention_decode"] = floor_bytes.pop("attention_decode")
    rows = []
    for name, entry in per_kernel.items():
        share = statistics.fmean(entry["share_us"])
        bytes_per_launch = floor_bytes.get(name, 0) / entry["launches_per_step"]
        rows.append({
            "kernel": name, "label": LABELS.get(name, name), "launches_per_step": entry["launches_per_step"],
            "share_us_per_launch": share, "share_us_per_step": share * entry["launches_per_step"],
            "head_start_us_per_launch": statistics.fmean(entry["head_start_us"]),
            "floor_us_per_launch": bytes_per_launch / bandwidth * 1e6 if bytes_per_launch else None,
        })
    rows.sort(key=lambda r: -r["share_us_per_step"])
    layer_begins = names.index("add_rmsnorm_cluster") if "add_rmsnorm_cluster" in names else None  # layer 0's input norm
    per_layer = (len(names) - 4) // config.num_layers  # but the embedding, the final norm, lm_head and argmax
    one_layer = [{"kernel": names[k], "label": LABELS.get(names[k], names[k]),
                  "share_us": float(np.mean(shares[:, k]) / 1e3), "head_start_us": float(np.mean(head_starts[:, k]) / 1e3)}
                 for k in range(layer_begins, layer_begins + per_layer)] if layer_begins is not None else []
    clock = np.unique(np.diff(np.sort(released.reshape(-1))))
    return {"rows": rows, "layer_0": one_layer, "step_us": float(np.median(step_ns) / 1e3),
            "shares_sum_us": float(np.median(shares.sum(axis=1)) / 1e3),
            "clock_smallest_nonzero_step_ns": int(clock[clock > 0].min()) if (clock > 0).any() else None}


# kernels/decode_persistent.cu's operations (OP_*), in the order its blocks walk them, and the kernel
# of the step with a kernel per operation that reads the same bytes (nanoqwen.byte_floor.kernel_bytes).
OPERATIONS = {"q|k|v + RoPE": QKV_ROPE_KERNEL, "attention": "attention_decode", "combine": None,
              "o": GEMV_KERNELS["o"], "gate+up + SwiGLU": "gemv_int4_gate_up_silu", "down": GEMV_KERNELS["down"]}


def record_persistent_steps(backend, page_table, prompt_tokens: int, modules, steps: int):
    """The persistent kernel's trace of `steps` decode steps from the end of a prompt of `prompt_tokens`: ns [steps, blocks,
    layers, operations, moments (began, waited, done)], 0 where a block took no part."""
    import cupy as cp

    from nanoqwen.cuda.abi import OPS_PER_LAYER, kernel_int

    layers = backend._persistent_layers
    moments = kernel_int("decode_persistent.cu", "TRACE_MOMENTS")
    trace = cp.zeros((layers.blocks, backend.config.num_layers, OPS_PER_LAYER, moments), dtype=cp.uint64)
    for module in modules:
        try:
            cp.ndarray((1,), cp.uint64, memptr=module.get_global("nq_persistent_trace"))[...] = trace.data.ptr
        except Exception:  # a module without the persistent kernel (attention's)
            continue
    backend.persistent = True
    graph = backend.decode_graph()
    backend.set_step_inputs(1, prompt_tokens, page_table)
    records = []
    for _ in range(steps):
        trace.fill(0)
        graph.launch()
        backend.stream.synchronize()
        records.append(trace.get().astype(np.int64))
    return np.stack(records)


def summarize_persistent(config, records, bandwidth: float, prompt_tokens: int = STEP_PROMPT_TOKENS) -> dict:
    """Per operation: its share of the step and its hand-off (see the module's docstring), in µs, the
    mean over steps of their sums over layers, and the blocks taking part."""
    names = list(OPERATIONS)
    share = defaultdict(list)
    handoff = defaultdict(list)
    blocks = defaultdict(list)
    layer_0 = defaultdict(list)
    for step in records:  # [blocks, layers, operations, moments]
        took_part = step[..., 0] > 0
        previous = step[..., 0][took_part].min()  # the step's first operation began
        sums, handoffs = defaultdict(float), defaultdict(float)
        for layer in range(config.num_layers):
            for op, name in enumerate(names):
                part = took_part[:, layer, op]
                if not part.any():
                    continue
                done = step[part, layer, op, 2].max()
                waited = step[part, layer, op, 1].min()
                sums[name] += (done - previous) / 1e3
                handoffs[name] += (waited - previous) / 1e3
                if layer == 0:
                    layer_0[name].append((done - previous) / 1e3)
                blocks[name].append(int(part.sum()))
                previous = done
        for name in sums:
            share[name].append(sums[name])
            handoff[name].append(handoffs[name])
    floor_bytes = kernel_bytes(config, prompt_tokens + 1)
    rows = []
    for name in names:
        if not share[name]:
            continue
        kernel = OPERATIONS[name]
        rows.append({"operation": name, "share_us_per_step": statistics.fmean(share[name]),
                     "share_us_per_layer": statistics.fmean(share[name]) / config.num_layers,
                     "handoff_us_per_layer": statistics.fmean(handoff[name]) / config.num_layers,
                     "floor_us_per_layer": floor_bytes[kernel] / config.num_layers / bandwidth * 1e6 if kernel else None,
                     "blocks_taking_part": statistics.median(blocks[name])})
    return {"operations": rows, "layer_0_us": {name: statistics.fmean(v) for name, v in layer_0.items()},
            "layers_us": float(statistics.fmean(sum(r) for r in zip(*share.values())))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .nanoqwen file of any size (random weights of a published shape: nanoqwen.random_model)")
    parser.add_argument("--steps", type=int, default=TIMING_STEPS)
    parser.add_argument("--context", type=int, default=STEP_PROMPT_TOKENS,
                        help="tokens of the random prompt the timed steps follow (default %(default)s)")
    parser.add_argument("--without-pdl", action="store_true",
                        help="capture the step without programmatic dependent launch: every kernel starts after the last")
    parser.add_argument("--json", type=output_path, help="write the summary and every recorded time here")
    args = parser.parse_args(argv)
    require_gpu("step_timeline")

    from nanoqwen.cuda.timing import read_bandwidth

    bandwidth = read_bandwidth()  # the floors' divisor, measured on this GPU
    model = load(args.model)
    backend, page_table, modules = traced_backend(model, args.context)
    backend.pdl = not args.without_pdl
    persistent = persistent_refusal(backend) is None  # this backend can also run the persistent kernel
    backend.persistent = False  # first the step with a kernel per operation
    names = step_launch_names(backend)
    start, released, step_ns = record_steps(backend, page_table, args.context, modules, len(names), args.steps)
    summary = summarize(model.config, names, start, released, step_ns, bandwidth, args.context)
    floor_us = sum(bytes_per_token(model.config, args.context).values()) / bandwidth * 1e6
    print(f"traced step {summary['step_us']:.1f} us (median of {args.steps}), shares add up to "
          f"{summary['shares_sum_us']:.1f}; byte floor {floor_us:.1f} us; {len(names)} launches; "
          f"smallest clock step seen {summary['clock_smallest_nonzero_step_ns']} ns")
    print(f"{'kernel':22s} {'launches':>8s} {'us/step':>8s} {'us/launch':>9s} {'floor/launch':>12s} {'head start':>10s}")
    for r in summary["rows"]:
        floor = "" if r["floor_us_per_launch"] is None else f"{r['floor_us_per_launch']:.2f}"
        print(f"{r['label']:22s} {r['launches_per_step']:8d} {r['share_us_per_step']:8.1f} {r['share_us_per_launch']:9.2f} "
              f"{floor:>12s} {r['head_start_us_per_launch']:10.2f}")
    print("layer 0, in order:", ", ".join(f"{r['label']} {r['share_us']:.2f}" for r in summary["layer_0"]))
    if persistent:
        records = record_persistent_steps(backend, page_table, args.context, modules, args.steps)
        inside = summarize_persistent(model.config, records, bandwidth, args.context)
        summary["persistent"] = inside
        print(f"persistent kernel: the layers take {inside['layers_us']:.1f} us (mean of {args.steps} steps)")
        print(f"{'operation':18s} {'us/step':>8s} {'us/layer':>9s} {'floor/layer':>11s} {'hand-off':>9s} {'blocks':>6s}")
        for r in inside["operations"]:
            floor = "" if r["floor_us_per_layer"] is None else f"{r['floor_us_per_layer']:.2f}"
            print(f"{r['operation']:18s} {r['share_us_per_step']:8.1f} {r['share_us_per_layer']:9.2f} {floor:>11s} "
                  f"{r['handoff_us_per_layer']:9.2f} {r['blocks_taking_part']:6.0f}")
    if args.json:
        record = step_timing_record("tools/step_timeline.py", argv or sys.argv[1:], [], args.context)
        record.pop("rows", None)
        record.update(summary, byte_floor_us=floor_us, read_bandwidth_bytes_per_s=bandwidth, launch_names=names,
                      start_ns=(start - start[:, :1]).tolist(), released_ns=(released - start[:, :1]).tolist(),
                      step_ns=step_ns.tolist())
        args.json.write_text(json.dumps(record, indent=1))
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
