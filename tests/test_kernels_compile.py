"""Every CUDA source in kernels/ builds with plain nvcc for sm_90a, without register spills.

Runs tools/compile_kernels.py (no GPU needed, only nvcc on PATH) into a temporary report, so
that the committed results/ptxas-report.txt changes only when someone regenerates it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_tool

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_every_kernel_compiles_without_spills(tmp_path):
    report = tmp_path / "ptxas-report.txt"
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "compile_kernels.py"), "--report", str(report)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, f"kernel compile check failed:\n{result.stderr[-4000:]}"
    text = report.read_text()
    for kernel in ("add_rmsnorm", "gemv_int4_from_hidden", "gemv_int4_gate_up_silu", "lm_head_logits",
                   "argmax_select_next", "rope_write_kv", "embed_tokens"):
        assert kernel in text, f"{kernel} missing from the ptxas report"


def test_ptxas_report_parser():
    parse_ptxas = load_tool("compile_kernels").parse_ptxas

    log = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_90a'\n"
        "ptxas info    : Function properties for k1\n"
        "    32 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers\n"
        "ptxas info    : Compiling entry function 'k2' for 'sm_90a'\n"
        "ptxas info    : Used 12 registers\n"
    )
    assert parse_ptxas(log) == [
        {"kernel": "k1", "registers": 40, "stack": 32, "spill_stores": 8, "spill_loads": 4},
        {"kernel": "k2", "registers": 12, "stack": 0, "spill_stores": 0, "spill_loads": 0},
    ]


def test_every_gemv_has_a_ring_depth_a_carve_out_and_a_ring_size():
    """The per-kernel GEMV settings of nanoqwen.cuda.backend name the same four kernels, and
    kernels/gemv_int4.cu gives each its ring-depth macro (with a default) and the `__device__ int
    <kernel>_ring_bytes` the host reads at start: a mismatch would only show on a GPU."""
    import re

    from nanoqwen.cuda.plan import GEMV_CARVEOUT_PERCENT, GEMV_MAX_WARPS, GEMV_STAGES_MACROS
    from nanoqwen.cuda.build import macro_defaults

    source = (REPO / "kernels" / "gemv_int4.cu").read_text()
    depths = macro_defaults("gemv_int4.cu")
    assert GEMV_STAGES_MACROS.keys() == GEMV_CARVEOUT_PERCENT.keys() == GEMV_MAX_WARPS.keys()
    for kernel, macro in GEMV_STAGES_MACROS.items():
        assert re.fullmatch(r"[1-9]\d*", depths.get(macro, "")), macro
        split_k = re.search(rf"NQ_GEMV_INT4_KERNEL\({kernel}, \w+, {macro}, \w+\)", source)
        assert split_k or f"__device__ int {kernel}_ring_bytes" in source, kernel


def test_chain_gemv_splits_fit_their_rings():
    """q|k|v and o split K until no warp has more groups than CHAIN_GEMV_GROUPS_PER_SPLIT, and their
    rings hold that many, so every group of a split is a ring slot of its own; down_proj keeps the
    warps-per-SM rule. The 7B on an H200 gets ten warps per tile for all three."""
    from nanoqwen.cuda.abi import GEMV_MAX_SPLITS
    from nanoqwen.cuda.plan import CHAIN_GEMV_GROUPS_PER_SPLIT, GEMV_KERNELS, GEMV_STAGES_MACROS, gemv_splits, projection_splits
    from nanoqwen.cuda.build import macro_defaults
    from nanoqwen.random_model import QWEN25_CODER_7B as c

    depths = macro_defaults("gemv_int4.cu")
    for projection, most in CHAIN_GEMV_GROUPS_PER_SPLIT.items():
        assert int(depths[GEMV_STAGES_MACROS[GEMV_KERNELS[projection]]]) >= most, projection
        for groups in (1, 2, 7, 12, 28, 47, 300):
            splits = projection_splits(projection, 512, groups * 128, 132)
            assert 1 <= splits <= GEMV_MAX_SPLITS
            assert -(-groups // splits) <= most or splits == GEMV_MAX_SPLITS, (projection, groups, splits)
    splits = {p: projection_splits(p, n, k, 132) for p, (n, k) in c.projection_shapes.items() if p in GEMV_KERNELS}
    assert splits == {"qkv": 10, "o": 10, "down": 10}
    assert projection_splits("down", 3584, 18944, 132) == gemv_splits(3584, 18944, 132)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_step_timeline_adds_no_shared_memory(tmp_path):
    """Built with NQ_TRACE (tools/step_timeline.py), every decode kernel keeps its static shared
    memory: a few bytes more per block could cost a one-wave GEMV a block per SM, and the
    timeline would then time another step than the engine's."""
    import re

    from nanoqwen.cuda.build import DECODER_KERNEL_FILES, kernel_dir, nvcc_command
    from nanoqwen.random_model import PRESETS

    config = PRESETS["qwen2.5-coder-7b"]
    entry = re.compile(r"Compiling entry function '(\w+)'.*?Used \d+ registers([^\n]*)", re.S)

    def static_smem(source: str, defines: dict) -> dict[str, int]:
        command = nvcc_command(config, kernel_dir() / source, tmp_path / "k.cubin", defines)
        log = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stderr
        smem = {name: re.search(r"(\d+) bytes smem", rest) for name, rest in entry.findall(log)}
        return {name: int(found.group(1)) if found else 0 for name, found in smem.items()}

    for source in (*DECODER_KERNEL_FILES, "paged_attention.cu"):
        plain, traced = static_smem(source, {}), static_smem(source, {"NQ_TRACE": "1"})
        assert plain and traced == plain, f"{source}: static shared memory {plain} untraced, {traced} traced"
