"""What every GPU record in results/ carries (when, on which GPU, from which commit, by which command), and
how it is written."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
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


def write_record(out: Path, record: dict, markdown: str) -> None:
    """OUT.json (the record) and OUT.md (its table), and the table on stdout."""
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    out.with_suffix(".md").write_text(markdown)
    print(markdown)


def record_command(tool: str, out: Path, *options: str, out_flag: str = "--out") -> str:
    """The command that makes a record again: `tool` with `options`, writing (`out_flag`) to results/
    under the name it was given (a device machine writes it elsewhere and it is copied there)."""
    return " ".join(["python3", tool, *options, out_flag, f"results/{Path(out).name}"])
