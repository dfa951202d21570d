"""Decode speed at every published Qwen2.5-Coder size against its byte floor, and the 7B at long context.

    python3 tools/decode_by_size.py --out results/decode-by-size-h100     # on a GPU machine (named by it)

Each size is a random-weight file of the published shapes (`nanoqwen.random_model` presets),
run through `Engine.generate` as `nanoqwen bench` runs it: a 512-token prompt, then 128 greedy
tokens, the median of `REPEATS` runs, once with the engine's decode step (a kernel per operation)
and once with the layers in one persistent kernel (`CudaBackend.persistent`, chapter 13). The
floor is the bytes one step must read at the run's mean context over the read bandwidth measured
at the start of the run (`nanoqwen.cuda.timing.read_bandwidth`). Peak GPU memory is the device
memory CuPy's pool holds after the runs: the engine allocates everything at start, and the pool
keeps what prefill took. Writes OUT.json (`{"rows": [{"model", "context", "ms_per_token",
"ms_per_token_persistent", "floor_ms", "share_of_floor", "peak_gpu_bytes", "prefill_weights",
"time_to_first_token_ms"}, ...]}` with date, GPU, commit, command and read bandwidth) and OUT.md,
again after every row, so that a run cut short leaves the rows it finished ("complete": false
until the last)."""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

from record import output_path, record_command, record_header, require_gpu, scratch_folder, write_record

PROMPT_TOKENS, NEW_TOKENS, REPEATS = 512, 128, 3
SIZES = ["0.5b", "1.5b", "3b", "7b", "14b", "32b"]
LONG_CONTEXTS = [4096, 16384]  # the 7B, prompt of this many tokens less NEW_TOKENS


def measure(model_path: Path, prompt_tokens: int, bandwidth: float) -> dict:
    import cupy as cp
    import numpy as np

    from nanoqwen import Engine
    from nanoqwen.byte_floor import floor_ms

    pool = cp.get_default_memory_pool()
    gc.collect()  # an earlier size's engine, held by reference cycles until collected
    pool.free_all_blocks()  # and what it left cached, are not this one's
    engine = Engine(model_path, backend="cuda", max_context=prompt_tokens + NEW_TOKENS)
    try:
        ids = np.random.default_rng(0).integers(0, engine.config.vocab_size, prompt_tokens).tolist()
        ms, runs = {}, None
        for persistent in (True, False):  # the engine's default last: its runs give the prefill times
            engine.backend.persistent = persistent
            engine.generate(ids[:32], max_new_tokens=8, stop_token_ids=[])  # compile, upload, capture
            runs = [engine.generate(ids, max_new_tokens=NEW_TOKENS, stop_token_ids=[]) for _ in range(REPEATS)]
            cp.cuda.Device().synchronize()
            ms[persistent] = 1e3 / statistics.median(r.decode_tokens_per_second for r in runs)
        floor = floor_ms(engine.config, prompt_tokens + NEW_TOKENS // 2, bandwidth)
        return dict(context=prompt_tokens + NEW_TOKENS, ms_per_token=ms[False], ms_per_token_persistent=ms[True],
                    floor_ms=floor, share_of_floor=floor / ms[False], peak_gpu_bytes=int(pool.total_bytes()),
                    prefill_weights=engine.backend.prefill_weights,
                    time_to_first_token_ms=statistics.median(r.prefill_seconds for r in runs) * 1e3)
    finally:
        engine.close()
        del engine
        pool.free_all_blocks()


def markdown(record: dict) -> str:
    lines = [f"# Decode by model size ({record['gpu']})", "",
             f"- date: {record['date']}; GPU: {record['gpu']}; commit: {record['commit']}",
             f"- command: `{record['command']}`",
             f"- protocol: random weights of the published shapes, a {PROMPT_TOKENS}-token prompt (or the context "
             f"given), {NEW_TOKENS} greedy tokens, median of {REPEATS}; floor: the step's bytes at the mean context "
             f"over the read bandwidth measured in the run, {record['read_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s", "",
             "| model | context | decode ms/token | floor ms | share of floor | the layers in one kernel | "
             "time to first token | peak GPU memory | prefill weights |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    if not record["complete"]:
        lines.insert(4, "- **incomplete**: the run ended before its last row")
    for r in record["rows"]:
        lines.append(f"| {r['model']} | {r['context']} | {r['ms_per_token']:.3f} | {r['floor_ms']:.3f} | "
                     f"{100 * r['share_of_floor']:.1f}% | {r['ms_per_token_persistent']:.3f} ms "
                     f"({100 * r['floor_ms'] / r['ms_per_token_persistent']:.1f}%) | "
                     f"{r['time_to_first_token_ms']:.1f} ms | {r['peak_gpu_bytes'] / 2**30:.1f} GiB | "
                     f"{r['prefill_weights']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_path, required=True, help="OUT.json and OUT.md are written")
    parser.add_argument("--sizes", nargs="+", default=SIZES, choices=SIZES)
    parser.add_argument("--long-contexts", nargs="*", type=int, default=LONG_CONTEXTS)
    args = parser.parse_args()
    short = [c for c in args.long_contexts if c <= NEW_TOKENS]
    if short:  # a context holds the prompt and the tokens generated after it
        parser.error(f"--long-contexts {short[0]}: a context must exceed the {NEW_TOKENS} tokens generated in it")
    require_gpu("decode_by_size")

    from nanoqwen.cuda.timing import read_bandwidth
    from nanoqwen.random_model import PRESETS, write_random_model

    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    # the 7B's long contexts right after its 512-token row, while its file is on disk
    long_7b = [("7b", c - NEW_TOKENS) for c in args.long_contexts]
    plan = [row for size in args.sizes for row in [(size, PROMPT_TOKENS), *(long_7b if size == "7b" else [])]]
    plan += [] if "7b" in args.sizes else long_7b
    header = record_header(record_command("tools/decode_by_size.py", args.out, "--sizes", *args.sizes, "--long-contexts",
                                          *map(str, args.long_contexts)))
    with scratch_folder() as scratch:
        rows = []
        for size, prompt_tokens in plan:
            model = scratch / f"{size}.nanoqwen"
            if not model.exists():
                for old in scratch.glob("*.nanoqwen"):
                    old.unlink()  # one model on disk at a time: the 32B alone is 19 GB
                write_random_model(model, PRESETS[f"qwen2.5-coder-{size}"])
            rows.append(dict(model=size, **measure(model, prompt_tokens, bandwidth)))
            r = rows[-1]
            print(f"{size:5} context {r['context']:6}: {r['ms_per_token']:.3f} ms/token, floor {r['floor_ms']:.3f} "
                  f"({100 * r['share_of_floor']:.1f}%), the layers in one kernel {r['ms_per_token_persistent']:.3f}, "
                  f"peak {r['peak_gpu_bytes'] / 2**30:.1f} GiB", flush=True)
            in_size_order = sorted(rows, key=lambda row: (SIZES.index(row["model"]), row["context"]))  # whatever order ran
            record = {**header, "read_bandwidth_bytes_per_s": bandwidth, "complete": len(rows) == len(plan),
                      "rows": in_size_order}
            write_record(args.out, record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
