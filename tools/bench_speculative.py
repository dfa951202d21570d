"""Speculative decoding on the GPU: what a verify pass costs, and what it buys on code edits.

    python3 tools/bench_speculative.py --out results/speculative-h100     # on a GPU machine (named by it)

1. Pass cost at the 7B's shapes (random weights of the published shapes, a 512-token prompt): the
   wall time of one `CudaBackend.verify` call of k = 1, 2, 4, 7, 8, 16 drafts (7: the widest pass
   the narrow kernels take; upload, graph, host
   read-back: what the engine pays per pass) against one decode step taken the same way
   (`decode_next`) and against plain decoding's pipelined ms/token (`Engine.generate`).
2. Acceptance: nano-coder on edit prompts (most of the output copies the prompt) and on a prompt
   of one line (nano-coder repeats itself there), for speculate = 4, 7, 8, 16: every pass's draft
   count and accepted tokens.
3. Effective 7B ms/token: each recorded verify pass priced at the 7B's cost of a pass of its draft
   count and each plain step at plain decoding's ms/token (they run pipelined), over the tokens
   made; and, measured directly on the 7B's random weights (nothing to copy),
   speculate = 8 against plain decoding.

4. Where a pass's time goes: the in-graph cost of each kernel of a decode step and of verify
   passes of 1, 2, 5, 8, 9 and 17 rows.

Writes OUT.json (pass_costs, kernel_us_per_launch, effective, no_copy_7b, with date, GPU, commit,
command) and OUT.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from record import output_path, record_command, record_header, require_gpu, scratch_folder, write_record

PROMPT_TOKENS, NEW_TOKENS, REPEATS = 512, 128, 20
DRAFT_COUNTS = [1, 2, 4, 7, 8, 16]  # 7: the most a narrow pass takes (8 rows)
KERNEL_ROWS = [1, 2, 5, 8, 9, 17]  # the per-kernel breakdown: both widths at both ends
SPECULATE = [4, 7, 8, 16]
EDIT_PROMPTS = ["type hints", "rename", "add a field"]  # of nanoqwen.testing.CODE_EDIT_PROMPTS
SHORT_PROMPT = "# A function that returns the n-th prime number\n"


def wall_ms(call, repeats: int = REPEATS) -> float:
    call()  # warm: capture
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def pass_costs(engine, rng) -> dict:
    """Wall ms of a verify pass per draft count and of one decode step, at PROMPT_TOKENS of context."""
    backend, vocab = engine.backend, engine.config.vocab_size
    pages = engine.allocator.allocate(-(-(PROMPT_TOKENS + 32) // 16))
    prompt = rng.integers(0, vocab, PROMPT_TOKENS)
    backend.prefill(prompt, 0, pages)
    step = wall_ms(lambda: backend.decode_next(1, PROMPT_TOKENS, pages))
    costs = {0: step}
    for k in DRAFT_COUNTS:
        drafts = rng.integers(0, vocab, k).tolist()
        costs[k] = wall_ms(lambda: backend.verify(1, drafts, PROMPT_TOKENS, pages))
    engine.allocator.free(pages)
    return costs


def kernel_costs(engine, rng) -> dict:
    """In-graph us per launch of each kernel of a decode step ("0") and of verify passes of
    KERNEL_ROWS rows (nanoqwen.cuda.profile.launch_costs), at PROMPT_TOKENS of context."""
    from nanoqwen.cuda.profile import launch_costs

    backend, vocab = engine.backend, engine.config.vocab_size
    pages = engine.allocator.allocate(-(-(PROMPT_TOKENS + 32) // 16))
    backend.prefill(rng.integers(0, vocab, PROMPT_TOKENS), 0, pages)
    backend.set_step_inputs(1, PROMPT_TOKENS, pages)
    costs = {"0": launch_costs(backend)[0]}
    for rows in KERNEL_ROWS:
        backend.verify(1, rng.integers(0, vocab, rows - 1).tolist(), PROMPT_TOKENS, pages)  # its inputs and buffers
        backend.set_step_inputs(1, PROMPT_TOKENS, pages)
        costs[str(rows)] = launch_costs(backend, launches=lambda stream: backend.verify_launches(rows, stream))[0]
    backend.forget_step_inputs()
    engine.allocator.free(pages)
    return costs


def plain_ms_per_token(engine, ids) -> float:
    engine.generate(ids[:32], max_new_tokens=8, stop_token_ids=[])
    runs = [engine.generate(ids, max_new_tokens=NEW_TOKENS, stop_token_ids=[]) for _ in range(3)]
    return 1e3 / statistics.median(r.decode_tokens_per_second for r in runs)


def recorded_run(engine, prompt: str, speculate: int) -> tuple[dict, list[tuple[int, int]]]:
    """One greedy generation; (summary, [(drafts, tokens made)] per pass: each verify pass's, then
    one (0, 1) for each plain step)."""
    backend, passes = engine.backend, []
    verify = backend.verify

    def recording_verify(token, drafts, *args, **kwargs):
        tokens = verify(token, drafts, *args, **kwargs)
        passes.append((len(drafts), len(tokens)))
        return tokens

    backend.verify = recording_verify
    try:
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[], speculate=speculate)
    finally:
        del backend.verify
    passes += [(0, 1)] * (result.decode_passes - len(passes))
    return dict(tokens_per_pass=result.tokens_per_pass, passes=result.decode_passes,
                drafted=result.drafted_tokens, accepted=result.accepted_drafts), passes


def priced(passes: list[tuple[int, int]], costs: dict) -> float:
    """7B ms/token of the recorded passes, each at the measured cost of its draft count (counts
    between the measured ones take the next measured count above)."""
    def cost(k: int) -> float:
        return costs[k] if k in costs else costs[min(m for m in costs if m >= k)]

    return sum(cost(k) for k, _ in passes) / sum(made for _, made in passes)


def markdown(record: dict) -> str:
    costs, plain = record["pass_costs_ms"], record["plain_ms_per_token"]
    lines = [f"# Speculative decoding ({record['gpu']})", "",
             f"- date: {record['date']}; GPU: {record['gpu']}; commit: {record['commit']}",
             f"- command: `{record['command']}`",
             f"- 7B shapes, random weights, {PROMPT_TOKENS}-token context; wall time per call, median of {REPEATS}; "
             f"byte floor of one pass {record['floor_ms']:.3f} ms at the read bandwidth measured in the run, "
             f"{record['read_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s", "",
             f"Plain decoding (pipelined, `Engine.generate`): **{plain:.3f} ms/token**.", "",
             "| pass | wall ms | vs one decode step |", "| --- | ---: | ---: |"]
    for k, ms in costs.items():
        label = "decode step (decode_next)" if k == "0" else f"verify, {k} drafts ({int(k) + 1} rows)"
        lines.append(f"| {label} | {ms:.3f} | {ms / costs['0']:.2f}x |")
    lines += ["", "Nano-coder's passes on each prompt (greedy), priced at the 7B's pass costs:", "",
              "| prompt | speculate | tokens per pass | drafts accepted | effective 7B ms/token | vs plain |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in record["effective"]:
        lines.append(f"| {row['prompt']} | {row['speculate']} | {row['tokens_per_pass']:.2f} | "
                     f"{row['accepted']}/{row['drafted']} | {row['ms_per_token']:.3f} | {plain / row['ms_per_token']:.2f}x |")
    kernels = record["kernel_us_per_launch"]
    widths = list(kernels)
    names = sorted({name for costs_of in kernels.values() for name in costs_of},
                   key=lambda name: -max(costs_of.get(name, 0.0) for costs_of in kernels.values()))
    lines += ["", "In-graph µs per launch of each kernel (`launch_costs`: all launches of a kernel in one graph), "
              "a decode step against verify passes of each row count:", "",
              "| kernel | " + " | ".join("decode" if w == "0" else f"{w} rows" for w in widths) + " |",
              "| --- |" + " ---: |" * len(widths)]
    for name in names:
        cells = [f"{kernels[w][name]:.2f}" if name in kernels[w] else "" for w in widths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    nc = record["no_copy_7b"]
    lines += ["", f"Nothing to copy, measured on the 7B's random weights: plain {nc['plain_ms_per_token']:.3f} ms/token, "
              f"speculate=8 {nc['speculative_ms_per_token']:.3f} ms/token ({nc['tokens_per_pass']:.2f} tokens per pass), "
              f"{100 * (nc['speculative_ms_per_token'] / nc['plain_ms_per_token'] - 1):+.1f}%."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_path, required=True, help="OUT.json and OUT.md are written")
    args = parser.parse_args()
    require_gpu("bench_speculative")

    import numpy as np

    import nanoqwen
    from nanoqwen import Engine
    from nanoqwen.byte_floor import floor_ms
    from nanoqwen.cli import DEFAULT_MODEL
    from nanoqwen.cuda.timing import read_bandwidth
    from nanoqwen.random_model import PRESETS, write_random_model
    from nanoqwen.testing import CODE_EDIT_PROMPTS

    rng = np.random.default_rng(0)
    bandwidth = read_bandwidth()
    with Engine(nanoqwen.load(DEFAULT_MODEL), backend="cuda") as coder:
        runs = {(name, n): recorded_run(coder, prompt, n) for name, prompt in
                [*((name, CODE_EDIT_PROMPTS[name]) for name in EDIT_PROMPTS), ("short prompt", SHORT_PROMPT)] for n in SPECULATE}
    with scratch_folder() as scratch:
        model = scratch / "7b.nanoqwen"
        write_random_model(model, PRESETS["qwen2.5-coder-7b"])
        with Engine(model, backend="cuda", max_context=PROMPT_TOKENS + NEW_TOKENS + 32) as engine:
            costs = pass_costs(engine, rng)
            kernels = kernel_costs(engine, rng)
            ids = rng.integers(0, engine.config.vocab_size, PROMPT_TOKENS).tolist()
            plain = plain_ms_per_token(engine, ids)
            speculative = [engine.generate(ids, max_new_tokens=NEW_TOKENS, stop_token_ids=[], speculate=8) for _ in range(3)]
            floor = floor_ms(engine.config, PROMPT_TOKENS, bandwidth)
    # plain steps run pipelined between the verify passes, at plain decoding's cost per token
    effective = [dict(prompt=name, speculate=n, **summary, ms_per_token=priced(passes, {**costs, 0: plain}))
                 for (name, n), (summary, passes) in runs.items()]
    record = {
        **record_header(record_command("tools/bench_speculative.py", args.out)),
        "read_bandwidth_bytes_per_s": bandwidth,
        "floor_ms": floor,
        "plain_ms_per_token": plain,
        "pass_costs_ms": {str(k): v for k, v in costs.items()},
        "kernel_us_per_launch": kernels,
        "effective": effective,
        "no_copy_7b": dict(plain_ms_per_token=plain,
                           speculative_ms_per_token=1e3 / statistics.median(r.decode_tokens_per_second for r in speculative),
                           tokens_per_pass=statistics.median(r.tokens_per_pass for r in speculative)),
    }
    write_record(args.out, record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
