"""How many greedy decode steps one CUDA graph launch should hold, measured as a user sees it.

`CudaBackend.greedy_tokens` launches graphs of `steps_per_graph` decode steps. Between two graph
launches the GPU finishes the first graph before it starts the second; inside a graph, one step
hands over to the next at an ordinary kernel boundary. This times `engine.generate` with the
article's protocol (a 512-token prompt, 128 greedy tokens) for each value, in rounds that
alternate the values so that drift shows as spread, and checks that every value gives the same
tokens. Run it from another tree (PYTHONPATH) to time that tree the same way: a backend without
`steps_per_graph` is timed as it is, under the value "as built".

    python3 -m nanoqwen.random_model /tmp/q7b.nanoqwen --preset qwen2.5-coder-7b
    PYTHONPATH=. python3 tools/sweep_steps_per_graph.py /tmp/q7b.nanoqwen --values 1 2 4 8 16 --json sweep.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .nanoqwen file")
    parser.add_argument("--values", type=int, nargs="+", default=[1, 8], help="steps per graph to time")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all values (default 3)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--label", default="", help="a name for this tree in the output")
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args(argv)

    import cupy as cp

    from nanoqwen.engine import Engine

    engine = Engine(args.model, backend="cuda", max_context=args.prompt_tokens + args.new_tokens)
    backend = engine.backend
    values = args.values if hasattr(backend, "steps_per_graph") else ["as built"]
    ids = np.random.default_rng(0).integers(0, engine.config.vocab_size, args.prompt_tokens).tolist()
    runs = {value: [] for value in values}
    tokens = {}
    try:
        for rounds in range(args.rounds + 1):  # round 0 warms up: compiles, uploads, captures
            for value in values:
                if value != "as built":
                    backend.steps_per_graph = value
                result = engine.generate(ids, max_new_tokens=args.new_tokens, stop_token_ids=[])
                tokens.setdefault(value, result.token_ids)
                if result.token_ids != tokens[value]:
                    raise AssertionError(f"steps_per_graph={value}: the tokens changed between runs")
                if rounds:
                    runs[value].append({"decode_ms_per_token": 1e3 / result.decode_tokens_per_second,
                                        "time_to_first_token_ms": result.prefill_seconds * 1e3})
    finally:
        engine.close()
    reference = tokens[values[0]]
    rows = []
    for value in values:
        assert tokens[value] == reference, f"steps_per_graph={value} gave other tokens than {values[0]}"
        decode = [r["decode_ms_per_token"] for r in runs[value]]
        rows.append({"steps_per_graph": value, "decode_ms_per_token_median": statistics.median(decode),
                     "decode_ms_per_token_runs": decode,
                     "time_to_first_token_ms_median": statistics.median(r["time_to_first_token_ms"] for r in runs[value])})
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(),
        "label": args.label, "command": " ".join(sys.argv), "model": args.model,
        "protocol": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rounds": args.rounds},
        "tokens_identical": True, "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    print(f"{args.label or 'this tree'}: {record['gpu']}, {record['date']}")
    print("| steps per graph | decode ms/token (median) | runs | time to first token, ms |")
    print("| ---: | ---: | --- | ---: |")
    for row in rows:
        runs_text = ", ".join(f"{t:.4f}" for t in row["decode_ms_per_token_runs"])
        print(f"| {row['steps_per_graph']} | {row['decode_ms_per_token_median']:.4f} | {runs_text} | "
              f"{row['time_to_first_token_ms_median']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
