"""What every GPU record in results/ carries (when, on which GPU, from which commit, by which command), and
how it is written."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def record_header(command: str) -> dict:
    """{"date", "gpu", "commit", "command"} for a record made now on the current GPU. A copy of the
    tree without .git (a device machine) names its commit in NANOQWEN_COMMIT."""
    import cupy as cp

    commit = os.environ.get("NANOQWEN_COMMIT") or subprocess.run(
        ["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True).stdout.strip() or "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "commit": commit,
        "command": command,
    }


def output_path(value: str) -> Path:
    """argparse's type for a file a tool writes when it ends (a record, a JSON report): a bad path is
    an error when the arguments are read, not after minutes of measuring."""
    from nanoqwen.format import output_file_problem

    problem = output_file_problem(value, renamed_over=False)  # written in place: /dev/null will do
    if problem is not None:
        raise argparse.ArgumentTypeError(str(problem))
    return Path(value)


def write_record(out: Path, record: dict, markdown: str) -> None:
    """OUT.json (the record) and OUT.md (its table), and the table on stdout."""
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    out.with_suffix(".md").write_text(markdown)
    print(markdown)


def record_command(tool: str, out: Path, *options: str, out_flag: str = "--out") -> str:
    """The command that makes a record again: `tool` with `options`, writing (`out_flag`) to results/
    under the name it was given (a device machine writes it elsewhere and it is copied there)."""
    return " ".join(["python3", tool, *options, out_flag, f"results/{Path(out).name}"])


def gpu_tag() -> str:
    """h100, h200 or gpu: the GPU's part of a record's name (results/<topic>-<tag>.md)."""
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return "h200" if "H200" in name else "h100" if "H100" in name else "gpu"


CUDA_SANITIZER = "/usr/local/cuda/bin/compute-sanitizer"  # where the CUDA toolkit puts it, when it is not on PATH


def compute_sanitizer() -> str | None:
    """The compute-sanitizer program to run, or None where this machine has none."""
    return shutil.which("compute-sanitizer") or (CUDA_SANITIZER if Path(CUDA_SANITIZER).is_file() else None)


def require_gpu(tool: str) -> None:
    """End `tool` with status 2 and one line on stderr when the CUDA backend cannot run here, before
    it builds a model or starts a child process only to fail in a traceback."""
    from nanoqwen.backends import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"{tool}: needs CuPy and a Hopper GPU ({reason})", file=sys.stderr)
        raise SystemExit(2)


@contextlib.contextmanager
def scratch_folder():
    """A temporary folder for model files (a 32B one is 19 GB), removed when the tool ends: normally,
    on an error or Ctrl-C, and on SIGTERM (what `timeout` sends), which is turned into SystemExit so
    that the removal runs."""
    from nanoqwen.format import termination_raises_system_exit

    with termination_raises_system_exit(), tempfile.TemporaryDirectory(prefix="nanoqwen-") as folder:
        yield Path(folder)
