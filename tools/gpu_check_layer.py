"""One call on a GPU machine: every check of the decoder-layer kernels, then the benchmark.

    export PYTHONUNBUFFERED=1
    PYTHONPATH=. python3 tools/gpu_check_layer.py --out "$OUT"

1. tests/test_kernels_cuda.py under pytest,
2. tools/bench_kernels.py at the 7B's shapes,
3. compute-sanitizer memcheck over a small model's prefill and decode steps, which launch
   every kernel of kernels/ at least once (CuPy's memory pool is switched off there, so each
   array is its own allocation and an out-of-bounds access cannot land in a neighbour),
4. chapters/04_norms.md's code cells as a plain script (its GPU cells run here), once
   results/kernels-h200.md exists.
Logs land in --out (pytest.log, memcheck.log, bench.md, chapter04.log); a summary table is
printed last.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run_logged(command: list[str], log: Path, env=None, timeout: int = 600, cwd: Path = REPO) -> tuple[int, str, float]:
    began = time.time()
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
        code, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as e:
        code, output = -1, f"{e.stdout or ''}{e.stderr or ''}\nTIMEOUT after {timeout} s"
    except FileNotFoundError as e:
        code, output = -2, f"not found: {e}"
    log.write_text(f"$ {' '.join(command)}\n{output}")
    return code, output, time.time() - began


def chapter_script(chapter: Path) -> str:
    """The code cells of a MyST chapter, in order, as one Python script."""
    cells, current = [], None
    for line in chapter.read_text().splitlines():
        if current is None and line.startswith("```{code-cell}"):
            current = []
        elif current is not None and line.strip() == "```":
            cells.append("\n".join(current))
            current = None
        elif current is not None and not line.startswith(":tags:"):
            current.append(line)
    return "\n\n".join(cells) + "\n"


def exercise(model_path: str, attention_name: str) -> None:
    """Prefill and decode a small model once with the CUDA backend (the memcheck target)."""
    import cupy as cp
    import numpy as np

    import nanoqwen
    from nanoqwen.cuda.backend import CudaBackend

    sys.path.insert(0, str(REPO / "tests"))
    from test_kernels_cuda import ATTENTIONS, OracleAttention

    cp.cuda.set_allocator(None)  # one cudaMalloc per array: memcheck sees every array's bounds
    model = nanoqwen.load(model_path)
    attention = ATTENTIONS[attention_name]
    backend = CudaBackend(model, 6, attention_factory=attention, use_graph=attention is not OracleAttention)
    page_table = np.array([4, 1, 5, 0], dtype=np.int32)
    rng = np.random.default_rng(0)
    logits = backend.prefill(rng.integers(0, model.config.vocab_size, 19), 0, page_table)
    token = int(np.argmax(logits))
    for position in range(19, 22):
        token = backend.decode_next(token, position, page_table)
    backend.decode(token, 22, page_table)
    print(f"exercised: attention {type(backend.attention).__name__}, {backend.launches_per_token} launches per token")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    parser.add_argument("--exercise", nargs=2, metavar=("MODEL", "ATTENTION"), help=argparse.SUPPRESS)
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--pytest-timeout", type=int, default=200, help="seconds")
    parser.add_argument("--memcheck-timeout", type=int, default=90, help="seconds")
    args = parser.parse_args(argv)
    if args.exercise:
        exercise(*args.exercise)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    summary = []

    code, output, seconds = run_logged(["nvidia-smi", "-L"], args.out / "gpu.log")
    print(output.strip())

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # GPU machines may lack the book's test plugins (nbval), which tests/conftest.py and the
    # project's pytest addopts need: run this file on its own. Its tests are not marked-and-
    # skipped here: test_kernels_cuda.py needs CuPy, and without a device they fail loudly.
    code, output, seconds = run_logged(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--noconftest", "-o", "addopts=",
         "tests/test_kernels_cuda.py"],
        args.out / "pytest.log", env=env, timeout=args.pytest_timeout,
    )
    tail = [line for line in output.strip().splitlines() if line.strip()]
    print("\n".join(tail[-25:]))
    summary.append(("pytest tests/test_kernels_cuda.py", tail[-1] if tail else "no output", f"{seconds:.0f} s"))

    if not args.skip_bench:
        code, output, seconds = run_logged(
            [sys.executable, "tools/bench_kernels.py", "--sweep", "--out", str(args.out / "bench.md")], args.out / "bench.log", env=env,
            timeout=120,
        )
        summary.append(("tools/bench_kernels.py", f"exit {code}", f"{seconds:.0f} s"))
        table = [line for line in output.splitlines() if line.startswith("|") or "copy" in line]
        print("\n".join(table) if code == 0 else output[-3000:])

    from nanoqwen.testing import make_nanoqwen

    sys.path.insert(0, str(REPO / "tests"))
    from test_kernels_cuda import ATTENTIONS, OracleAttention

    with tempfile.TemporaryDirectory() as tmp:
        model = make_nanoqwen(tmp, seed=5, tokenizer=False, hidden_size=384, intermediate_size=640, num_heads=6,
                              num_kv_heads=2, head_dim=64, vocab_size=1000)
        # The oracle attention first: this file's kernels are the subject; then the real one.
        for attention in sorted(ATTENTIONS):
            code, output, seconds = run_logged(
                [shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer", "--tool", "memcheck",
                 sys.executable, __file__, "--exercise", str(model), attention],
                args.out / f"memcheck-{attention}.log", env=env, timeout=args.memcheck_timeout,
            )
            errors = re.findall(r"ERROR SUMMARY: (\d+) error", output)
            exercised = re.findall(r"exercised: .*", output)
            print(output.strip().splitlines()[-3:] if output.strip() else "memcheck: no output")
            summary.append((f"compute-sanitizer memcheck, {attention} attention",
                            f"exit {code}, {errors[-1] if errors else '?'} errors; "
                            f"{exercised[-1] if exercised else 'did not finish'}", f"{seconds:.0f} s"))

    chapter = REPO / "chapters" / "04_norms.md"
    if (REPO / "results" / "kernels-h200.md").exists():
        script = args.out / "chapter04.py"
        script.write_text(chapter_script(chapter))
        code, output, seconds = run_logged([sys.executable, str(script.resolve())], args.out / "chapter04.log", env=env,
                                           cwd=chapter.parent)
        summary.append(("chapters/04_norms.md, code cells as a script", f"exit {code}", f"{seconds:.0f} s"))
        print(output[-1500:])
    else:
        summary.append(("chapters/04_norms.md", "skipped: results/kernels-h200.md not recorded yet", "-"))

    print("\n| check | result | time |\n| --- | --- | --- |")
    for name, result, seconds in summary:
        print(f"| {name} | {result} | {seconds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
