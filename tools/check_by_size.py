"""The engine against transformers at every published Qwen2.5-Coder size, and one long prompt.

    python3 tools/check_by_size.py --out results/check-by-size-h200     # on a GPU machine

For each size, a random-weight file of the published shapes (`nanoqwen.random_model` presets)
is written to a scratch folder and `tools/check_vs_transformers.py` runs on it in a process of
its own (each frees its GPU memory when it ends). Where the fp32 reference of every layer would not
fit in the GPU's memory beside the engine, the model keeps its published widths and fewer layers
(`LAYERS`), and the record says so. Writes OUT.json (every check's record) and OUT.md (one row
per check).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from record import output_path, record_command, record_header, require_gpu, scratch_folder

TOOLS = Path(__file__).resolve().parent
# preset -> layers kept (None: all). 32B's 64 layers in fp32 are ~125 GB: 40 keep the reference at ~84 GB.
LAYERS = {"qwen2.5-coder-0.5b": None, "qwen2.5-coder-1.5b": None, "qwen2.5-coder-3b": None,
          "qwen2.5-coder-7b": None, "qwen2.5-coder-14b": None, "qwen2.5-coder-32b": 40}
LONG_PROMPT = ("qwen2.5-coder-1.5b", 8192)  # a prompt past 8k tokens, at a size whose reference attends to it quickly
STEPS = 32
TIMEOUT_S = 300  # per check, unless --timeout


def run_check(model: Path, prompt_tokens: int, json_path: Path, timeout: int) -> tuple[int, str]:
    command = [sys.executable, str(TOOLS / "check_vs_transformers.py"), "--model", str(model), "--steps", str(STEPS),
               "--prompt-tokens", str(prompt_tokens), "--json", str(json_path)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout} s"


def row(preset: str, layers: int | None, prompt_tokens: int, record: dict | None, status: int, log: str) -> dict:
    if record is None:
        return dict(preset=preset, layers_kept=layers, prompt_tokens=prompt_tokens, passed=False, error=log[-500:])
    c = record["model"]["config"]
    return dict(preset=preset, layers=c["num_layers"], layers_kept=layers, hidden=c["hidden_size"],
                mlp=c["intermediate_size"], heads=f"{c['num_heads']}:{c['num_kv_heads']}", tied=c["tie_word_embeddings"],
                prompt_tokens=prompt_tokens, passed=record["passed"],
                worst_error_over_tolerance=record["counts"]["worst_error_over_tolerance"],
                disagreements=record["counts"]["disagreements"], failures=record["failures"])


def markdown(record: dict) -> str:
    lines = [f"# The engine against transformers at every Qwen2.5-Coder size ({record['gpu']})", "",
             f"- date: {record['date']}", f"- GPU: {record['gpu']}", f"- command: `{record['command']}`",
             "- each check: `tools/check_vs_transformers.py` (random weights of the published shapes, transformers "
             f"fp32 holding the same dequantized weights, {STEPS} teacher-forced decode steps; tolerance: "
             f"{record['tolerance']})", "",
             "| size | layers | hidden, MLP, heads q:kv, tied | prompt | worst error / tolerance | verdict |",
             "| --- | ---: | --- | ---: | ---: | --- |"]
    for r in record["rows"]:
        if "error" in r:
            lines.append(f"| {r['preset']} | | | {r['prompt_tokens']} | | did not run: {r['error'][-120:]!r} |")
            continue
        layers = f"{r['layers']}" + (" (cut: the fp32 reference)" if r["layers_kept"] else "")
        lines.append(f"| {r['preset']} | {layers} | {r['hidden']}, {r['mlp']}, {r['heads']}, {'tied' if r['tied'] else 'untied'} "
                     f"| {r['prompt_tokens']} | {r['worst_error_over_tolerance']:.3f} | {'PASS' if r['passed'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def write_record(out: Path, header: dict, rows: list[dict], records: list) -> None:
    first = next((r for r in records if r), None)
    record = {
        **header,
        "tolerance": first["tolerance"]["formula"] if first else None,
        "rows": rows, "checks": records,
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    out.with_suffix(".md").write_text(markdown(record))


def command(args) -> str:
    """The command that makes the record again: the options it ran with, writing to results/."""
    options = ["--presets", *args.presets] + ["--no-long-prompt"] * args.no_long_prompt
    options += [] if args.timeout == TIMEOUT_S else ["--timeout", str(args.timeout)]
    return record_command("tools/check_by_size.py", args.out, *options)


def check_all(args, scratch: Path, header: dict) -> list[dict]:
    """Every check in turn, its model written to `scratch`; the record is written after each."""
    from nanoqwen.random_model import PRESETS, write_random_model

    checks = [(p, 45) for p in args.presets]
    if not args.no_long_prompt:  # beside its size, whose file is still on disk
        checks.insert(checks.index((LONG_PROMPT[0], 45)) + 1 if (LONG_PROMPT[0], 45) in checks else len(checks), LONG_PROMPT)
    rows, records = [], []
    for preset, prompt_tokens in checks:
        layers = LAYERS[preset]
        config = PRESETS[preset]
        if layers is not None:
            config = dataclasses.replace(config, num_layers=layers)
        model = scratch / f"{preset}.nanoqwen"
        if not model.exists():
            for old in scratch.glob("*.nanoqwen"):
                old.unlink()  # one model on disk at a time
            write_random_model(model, config)
        json_path = scratch / f"{preset}-{prompt_tokens}.json"
        status, log = run_check(model, prompt_tokens, json_path, args.timeout)
        record = json.loads(json_path.read_text()) if json_path.exists() else None
        rows.append(row(preset, layers, prompt_tokens, record, status, log))
        records.append(record)
        r = rows[-1]
        print(f"{preset:20} prompt {prompt_tokens:5}: " + (f"{r['worst_error_over_tolerance']:.3f} of the tolerance, "
              f"{'PASS' if r['passed'] else 'FAIL'}" if "error" not in r else f"did not run ({status})"), flush=True)
        write_record(args.out, header, rows, records)  # after every check: a run cut short keeps what it measured
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_path, required=True, help="OUT.json and OUT.md are written")
    parser.add_argument("--presets", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--no-long-prompt", action="store_true")
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per check")
    args = parser.parse_args()
    require_gpu("check_by_size")

    header = record_header(command(args))
    with scratch_folder() as scratch:
        rows = check_all(args, scratch, header)
    print(markdown(json.loads(args.out.with_suffix(".json").read_text())))
    return 0 if all(r.get("passed") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
