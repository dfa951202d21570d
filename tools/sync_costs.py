"""What it costs the GPU's blocks to wait for each other, three ways (tools/sync_costs.cu).

The decode step hands every activation from one kernel to the next. Would one persistent kernel,
with barriers between its stages, hand them over faster? This times, on the GPU at hand, each
way of passing one value from block 0 to every block of `--blocks` blocks of 256 threads:

    kernel boundary, PDL     a CUDA graph of --rounds kernels launched with programmatic
                             dependent launch (nanoqwen.cuda.launch), each waiting for the one before
    kernel boundary, plain   the same graph launched plainly
    grid barrier             one persistent kernel: an atomic counter in global memory, release
                             and acquire, --rounds barriers in a row
    cluster hand-off         8-block clusters: block 0 writes its shared memory, a cluster barrier,
                             every block reads it, a second barrier before the next write

Each figure is the median over --repeats timings (CUDA events) divided by --rounds. Every way
checks that each block saw the value it was handed.

    PYTHONPATH=. python3 tools/sync_costs.py --json sync.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoqwen.cuda.backend import persistent_blocks  # noqa: E402
from nanoqwen.cuda.graph import capture  # noqa: E402
from nanoqwen.cuda.launch import ProgrammaticKernel  # noqa: E402

THREADS = 256
CLUSTER = 8  # tools/sync_costs.cu __cluster_dims__


def timed_us(cp, stream, run, repeats: int, per: int) -> float:
    """Median µs of `run()` on `stream` over `repeats` timings, divided by `per`."""
    run()  # warm-up
    times = []
    for _ in range(repeats):
        begin, end = cp.cuda.Event(), cp.cuda.Event()
        begin.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(begin, end) * 1e3 / per)
    return statistics.median(times)


def measure(blocks: int, rounds: int, repeats: int) -> dict[str, float]:
    import cupy as cp

    module = cp.RawModule(code=(Path(__file__).with_suffix(".cu")).read_text(), options=("-std=c++17",))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # every fill, launch and read below in one stream's order
        return _measure_on(cp, module, stream, blocks, rounds, repeats)


def _measure_on(cp, module, stream, blocks: int, rounds: int, repeats: int) -> dict[str, float]:
    data = cp.zeros(1 + rounds, dtype=cp.int32)
    results = {}

    handoff = module.get_function("kernel_handoff")
    for label, kernel in (("kernel boundary, PDL", ProgrammaticKernel(handoff, "kernel_handoff")),
                          ("kernel boundary, plain", handoff)):
        graph = capture(stream, lambda kernel=kernel: [kernel((blocks,), (THREADS,), (data,), stream=stream)
                                                       for _ in range(rounds)])
        data.fill(0)
        results[label] = timed_us(cp, stream, lambda graph=graph: graph.launch(stream), repeats, rounds)
        launches = int(data[0].get())
        if launches != (repeats + 1) * rounds:  # every kernel read what the one before wrote
            raise AssertionError(f"{label}: {launches} hand-offs counted, {(repeats + 1) * rounds} expected")

    counter = cp.zeros(1, dtype=cp.uint32)
    grid_barriers = module.get_function("grid_barriers")
    # A block that is not resident never arrives, and the others would spin forever.
    resident = persistent_blocks(grid_barriers, THREADS, cp.cuda.Device().attributes["MultiProcessorCount"])
    if blocks > resident:
        raise ValueError(f"--blocks {blocks}: the grid barrier needs every block resident at once, "
                         f"and this GPU holds {resident} blocks of {THREADS} threads")

    def grid_run():
        counter.fill(0)
        grid_barriers((blocks,), (THREADS,), (counter, data, np.int32(rounds)), stream=stream)

    data.fill(0)
    results["grid barrier"] = timed_us(cp, stream, grid_run, repeats, rounds)
    if int(data[0].get()):
        raise AssertionError(f"grid barrier: {int(data[0].get())} blocks read a value before it was written")

    cluster_blocks = -(-blocks // CLUSTER) * CLUSTER
    cluster = module.get_function("cluster_barriers")
    data.fill(0)
    results["cluster hand-off"] = timed_us(
        cp, stream, lambda: cluster((cluster_blocks,), (THREADS,), (data, np.int32(rounds)), stream=stream),
        repeats, rounds)
    if int(data[0].get()):
        raise AssertionError(f"cluster hand-off: {int(data[0].get())} reads saw the wrong value")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=132, help="blocks of 256 threads (all resident at once)")
    parser.add_argument("--rounds", type=int, default=200, help="hand-offs per timing")
    parser.add_argument("--repeats", type=int, default=20, help="timings; the median is reported")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    for name in ("blocks", "rounds", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")

    import cupy as cp

    results = measure(args.blocks, args.rounds, args.repeats)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"{gpu}, {args.blocks} blocks of {THREADS} threads, median of {args.repeats} x {args.rounds} hand-offs")
    print("| way | µs per hand-off |\n|---|---:|")
    for label, us in results.items():
        print(f"| {label} | {us:.3f} |")
    if args.json:
        record = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "gpu": gpu,
                  "command": "tools/sync_costs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "blocks": args.blocks, "threads": THREADS, "rounds": args.rounds, "repeats": args.repeats,
                  "us_per_handoff": results}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
