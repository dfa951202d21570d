"""Compile every kernel in kernels/ with plain nvcc for sm_90a at every published Qwen2.5-Coder
size, and write ptxas's register/spill report of the 7B.

This is CI's check that the CUDA sources build, on a machine with nvcc and no GPU: the
engine compiles the same files at run time through NVRTC (nanoqwen/cuda/build.py), with
the same -D constants, which are all a kernel file may rely on. The constants change what
ptxas does with a kernel (a row of 5120 halves needs more registers than one of 3584), so
every size is compiled. It fails on any compiler error and on any register spill at any size,
since a kernel that spills in its hot loop is slower than its byte count promises.

    python tools/compile_kernels.py                      # writes results/ptxas-report.txt
    python tools/compile_kernels.py --report /tmp/r.txt
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from nanoqwen.cuda import build
from nanoqwen.random_model import PRESETS, QWEN25_CODER_7B

ENTRY = re.compile(r"Compiling entry function '(\w+)'")
USAGE = re.compile(r"Used (\d+) registers")
SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str) -> list[dict]:
    """One record per kernel: name, registers, stack frame, spill store/load bytes."""
    kernels, current = [], None
    for line in log.splitlines():
        if m := ENTRY.search(line):
            current = {"kernel": m.group(1), "registers": None, "stack": 0, "spill_stores": 0, "spill_loads": 0}
            kernels.append(current)
        elif current is not None and (m := SPILLS.search(line)):
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        elif current is not None and (m := USAGE.search(line)):
            current["registers"] = int(m.group(1))
    return kernels


def compile_source(preset: str, source: Path, folder: Path) -> tuple[str | None, list[dict]]:
    """nvcc's error log (None when it built) and ptxas's records of `source` at the sizes of `preset`."""
    command = build.nvcc_command(PRESETS[preset], source, folder / f"{source.stem}-{preset}.cubin")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return result.stdout + result.stderr, []
    return None, parse_ptxas(result.stdout + result.stderr)


def compile_all(report: Path) -> int:
    folder = build.kernel_dir()
    sources = sorted(folder.glob("*.cu"))
    lines = [
        "ptxas resource report: every kernel in kernels/ for sm_90a, Qwen2.5-Coder-7B dimensions",
        "command: python tools/compile_kernels.py",
        f"defines: {' '.join(build.define_options(build.kernel_defines(QWEN25_CODER_7B)))}",
        "",
        f"{'file':<24} {'kernel':<40} {'regs':>5} {'stack':>6} {'spill st':>9} {'spill ld':>9}",
    ]
    jobs = [(preset, source) for preset in PRESETS for source in sources]
    failures, spills_elsewhere = [], []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        results = pool.map(lambda job: compile_source(*job, Path(tmp)), jobs)
        for (name, source), (error, kernels) in zip(jobs, results):
            is_report = PRESETS[name] is QWEN25_CODER_7B
            if error is not None:
                failures.append(f"{name} {source.name}: nvcc failed\n{error}")
                if is_report:
                    lines.append(f"{source.name:<24} COMPILE ERROR")
                continue
            for k in kernels:
                if is_report:
                    lines.append(
                        f"{source.name:<24} {k['kernel']:<40} {k['registers']:>5} {k['stack']:>6} "
                        f"{k['spill_stores']:>9} {k['spill_loads']:>9}"
                    )
                if k["spill_stores"] or k["spill_loads"]:
                    failures.append(f"{name} {source.name}: {k['kernel']} spills registers")
                    if not is_report:
                        spills_elsewhere.append(f"{name:<20} {source.name:<24} {k['kernel']:<40} {k['registers']:>5} "
                                                f"{k['spill_stores']:>9} {k['spill_loads']:>9}")
    others = ", ".join(name for name, config in PRESETS.items() if config is not QWEN25_CODER_7B)
    lines += ["", f"spills at the other published sizes ({others}): {len(spills_elsewhere) or 'none'}", *spills_elsewhere]
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=REPO / "results" / "ptxas-report.txt")
    args = parser.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("compile_kernels: needs nvcc on PATH (the CUDA toolkit's bin folder)", file=sys.stderr)
        return 2
    return compile_all(args.report)


if __name__ == "__main__":
    sys.exit(main())
