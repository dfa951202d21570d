"""compute-sanitizer over a whole generation on the CUDA engine: memcheck, racecheck, synccheck and
initcheck, each in its own process, each over the same requests.

    python3 tools/sanitize_engine.py --json results/sanitizer-engine-h100.json   # on a GPU machine (named by it)

The model is small enough for the sanitizers' slowdown (2 layers, hidden 640, heads 5:1, MLP
1792, tied lm_head; `nanoqwen.testing`'s weights, whose logits have clear winners), and the
requests reach every kernel the engine launches: a 37-token prompt (two full KV pages and a
partly filled third; a motif twice over) through prefill, then greedy, temperature, top-k and top-p
generations through the captured decode graph, and greedy and sampled ones with speculate=4
through the verify passes' graphs, and greedy and sampled ones again with the layers in one
persistent kernel (`CudaBackend.persistent`). CuPy's memory pool
is switched off, so every array is an allocation of its own and an access past its end is an
error rather than a read of a neighbour. Each run also checks its tokens against the NumPy
backend's greedy ones, so a sanitizer that changed the schedule cannot pass a wrong answer.

The record lists, per tool, the summary line, the kernels its reports name, and an excerpt.
racecheck's hazards inside cuBLAS's own GEMM kernels (prefill) are listed apart: nanoqwen's
kernels must have none.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from record import (CUDA_SANITIZER, compute_sanitizer, output_path, record_command, record_header, require_gpu,
                    scratch_folder)

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
SHAPE = dict(num_layers=2, hidden_size=640, intermediate_size=1792, num_heads=5, num_kv_heads=1, head_dim=128,
             vocab_size=2048, tie_word_embeddings=True)
PROMPT_TOKENS = 37
NEW_TOKENS = 6
REQUESTS = {"greedy": {}, "temperature 0.8": dict(temperature=0.8, seed=1),
            "top-k 20": dict(temperature=0.8, top_k=20, seed=2), "top-p 0.9": dict(temperature=0.8, top_p=0.9, seed=3),
            "greedy, speculate 4": dict(speculate=4), "temperature 0.8, speculate 4": dict(temperature=0.8, seed=1, speculate=4)}
PERSISTENT_REQUESTS = ("greedy", "temperature 0.8")  # again, decoding with the persistent kernel
TIMEOUT_S = 420
KERNEL_NAME = re.compile(r"(?:at|in) (?:0x[0-9a-f]+ in )?([A-Za-z_][\w:<>, ]*?)\+0x")


def run_requests(model_path: Path) -> None:
    """The child: every request on the CUDA engine, the greedy one checked against numpy's."""
    import cupy as cp
    import numpy as np

    import nanoqwen

    cp.cuda.set_allocator(None)
    # A motif twice over: the speculative requests find drafts in it and run verify passes.
    motif = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], PROMPT_TOKENS // 2 + 1).tolist()
    prompt = (motif * 2)[:PROMPT_TOKENS]
    with nanoqwen.Engine(model_path, backend="numpy") as engine:
        expected = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[]).token_ids
    with nanoqwen.Engine(model_path, backend="cuda", max_context=256) as engine:
        runs = [(label, settings, False) for label, settings in REQUESTS.items()]
        runs += [(label, REQUESTS[label], True) for label in PERSISTENT_REQUESTS]
        for label, settings, persistent in runs:
            engine.backend.persistent = persistent
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[], **settings)
            tokens = result.token_ids
            label += ", persistent kernel" if persistent else ""
            if label.startswith("greedy") and tokens != expected:
                raise SystemExit(f"{label}: tokens {tokens} differ from numpy's {expected}")
            print(f"{label}: {tokens}, {result.accepted_drafts} of {result.drafted_tokens} drafts accepted", flush=True)
        cp.cuda.Device().synchronize()


def summarize(tool: str, text: str, returncode) -> dict:
    lines = text.splitlines()
    summary = [line for line in lines if "ERROR SUMMARY" in line or "RACECHECK SUMMARY" in line]
    kernels = sorted({m.group(1).strip() for line in lines if line.startswith("=========") for m in [KERNEL_NAME.search(line)] if m})
    ours = [k for k in kernels if not re.match(r"(sm\d+_xmma|cutlass|nvjet|.*gemm|.*cublas)", k, re.I)]
    return dict(tool=tool, exit=returncode, summary=summary[-1] if summary else "(no summary)",
                kernels_reported=kernels, nanoqwen_kernels_reported=ours,
                excerpt=[line for line in lines if line.startswith("=========")][:30])


def sanitize(sanitizer: str, tool: str, model_path: Path, logs: Path | None) -> dict:
    """One sanitizer over the child's requests: its summary (and its full log in `logs`)."""
    # memcheck also reports CUDA API calls that return an error, and the CUDA libraries probe
    # the driver's entry points that way (cuGetProcAddress): those are not memory errors.
    extra = {"racecheck": ["--racecheck-report", "hazard"], "memcheck": ["--report-api-errors", "no"]}.get(tool, [])
    command = [sanitizer, "--tool", tool, "--print-limit", "100", *extra, sys.executable, __file__, "--child", str(model_path)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        text, code = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    row = summarize(tool, text, code)
    print(f"{tool:10} exit {code!s:8} {row['summary']}  nanoqwen kernels: {row['nanoqwen_kernels_reported'] or 'none'}",
          flush=True)
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"sanitizer-{tool}.txt").write_text(text)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=output_path, help="write the record here")
    parser.add_argument("--logs", type=Path, help="a folder for the sanitizers' full logs")
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_requests(args.child)
        return 0
    sanitizer = compute_sanitizer()
    if sanitizer is None:
        print(f"sanitize_engine: needs compute-sanitizer (not on PATH, no {CUDA_SANITIZER})", file=sys.stderr)
        return 2
    require_gpu("sanitize_engine")

    from nanoqwen.testing import make_nanoqwen

    with scratch_folder() as scratch:
        model_path = make_nanoqwen(scratch, tokenizer=False, **SHAPE)
        rows = [sanitize(sanitizer, tool, model_path, args.logs) for tool in args.tools]
    tools = [] if args.tools == list(TOOLS) else ["--tools", *args.tools]
    json_path = args.json or Path("sanitizer-engine-GPU.json")
    record = {
        **record_header(record_command("tools/sanitize_engine.py", json_path, *tools, out_flag="--json")),
        "model": {**SHAPE, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "requests": list(REQUESTS),
                  "persistent_kernel_requests": list(PERSISTENT_REQUESTS)},
        "runs": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    clean = all(r["exit"] == 0 and not r["nanoqwen_kernels_reported"]
                and (r["tool"] == "racecheck" or " 0 errors" in r["summary"]) for r in rows)
    print("PASS" if clean else "FAIL")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
