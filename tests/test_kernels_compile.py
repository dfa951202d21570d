"""Every CUDA source in kernels/ builds with plain nvcc for sm_90a at every published size,
without register spills.

Runs tools/compile_kernels.py (no GPU needed, only nvcc on PATH) into a temporary report, so
that the committed results/ptxas-report.txt changes only when someone regenerates it.
"""

from __future__ import annotations

import re
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
    assert re.search(r"^spills at the other published sizes \(.+\): none$", text, re.M), "a kernel spills at another published size"


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
        split_k = re.search(rf"NQ_GEMV_INT4_KERNEL\({kernel}, \w+, {macro}, \w+, \w+,\s*\w+\)", source)
        assert split_k or f"__device__ int {kernel}_ring_bytes" in source, kernel


# (warps per block, registers per thread, blocks per SM): the driver's occupancy answers for GEMV
# blocks with 3-deep rings on an H100, among them register counts of deeper rings
DRIVER_RESIDENT_BLOCKS = [(3, 64, 10), (4, 64, 8), (6, 64, 5), (7, 64, 4), (8, 64, 4), (10, 64, 3), (14, 64, 2),
                          (16, 64, 2), (12, 55, 3), (7, 76, 3), (10, 76, 2), (8, 78, 3), (5, 82, 4), (7, 82, 2)]


@pytest.mark.parametrize("warps, registers, blocks", DRIVER_RESIDENT_BLOCKS)
def test_resident_blocks_counts_as_the_driver_does(warps, registers, blocks):
    """Registers go to warps from their scheduler's quarter of the file, which is why 7 warps of 82
    registers fit twice, not three times."""
    from nanoqwen.cuda.plan import resident_blocks

    assert resident_blocks(warps, registers, warps * 3 * 1280 + 1024) == blocks


def test_chain_gemvs_take_the_most_warps_that_fit_one_wave():
    """q|k|v and o get the most warps per tile (at most one group each, at most a block's) with which
    every block is resident at once within the projection's share of an SM, and one warp more per
    tile would not fit; down_proj keeps the warps-per-SM rule. The published shapes on Hopper's 132
    SMs: the 7B's q|k|v ten warps per tile and o twelve; the 14B's and 32B's eight each, where
    fourteen warps of three groups took two waves."""
    from nanoqwen.cuda.abi import GEMV_MAX_SPLITS
    from nanoqwen.cuda.plan import (
        HOPPER_SM, chain_block_shared_bytes, chain_gemv_registers, chain_sm_budget, gemv_splits, projection_splits,
        resident_blocks,
    )
    from nanoqwen.random_model import PRESETS

    def one_wave(projection, rows, splits, sms):
        budget = chain_sm_budget(projection)
        blocks = resident_blocks(splits, chain_gemv_registers(), chain_block_shared_bytes(splits, 128), budget)
        return -(-rows // 16) <= sms * blocks

    assert chain_gemv_registers() == 64
    for projection in ("qkv", "o"):
        for rows in (16, 100, 1152, 4608, 7168, 40000):
            for groups in (1, 3, 7, 28, 40, 300):
                for sms in (8, 114, 132):
                    splits = projection_splits(projection, rows, groups * 128, sms, sm=HOPPER_SM)
                    assert 1 <= splits <= min(groups, GEMV_MAX_SPLITS)
                    assert splits == 1 or one_wave(projection, rows, splits, sms), (projection, rows, groups, sms)
                    if splits < min(groups, GEMV_MAX_SPLITS):
                        assert not one_wave(projection, rows, splits + 1, sms), (projection, rows, groups, sms)
    splits = {name: {p: projection_splits(p, *config.projection_shapes[p], 132) for p in ("qkv", "o", "down")}
              for name, config in PRESETS.items()}
    assert splits["qwen2.5-coder-7b"] == {"qkv": 10, "o": 12, "down": 10}
    assert splits["qwen2.5-coder-14b"] == splits["qwen2.5-coder-32b"] == {"qkv": 8, "o": 8, "down": 7}
    assert splits["qwen2.5-coder-0.5b"]["qkv"] == 7  # one group per warp: 896 inputs
    assert projection_splits("down", 3584, 18944, 132) == gemv_splits(3584, 18944, 132)


def test_gate_up_takes_the_most_warps_whose_last_wave_is_not_a_sliver():
    """gate+up gets the most warps per tile (at most a block's, at least two groups each) whose
    blocks end in their only wave or in a last wave at least a quarter full, and no more warps
    within those bounds would; the published shapes on Hopper's 132 SMs: four warps per tile,
    three at the 3B (four would leave 28 of its 688 tiles to a second wave) and at the 0.5B (seven
    input groups)."""
    from nanoqwen.cuda.abi import GATE_UP_MAX_SPLITS
    from nanoqwen.cuda.plan import (
        GATE_UP_MIN_GROUPS_PER_SPLIT, LAST_WAVE_MIN_FILL, gate_up_block_shared_bytes, gate_up_registers,
        gate_up_splits, projection_splits, resident_blocks,
    )
    from nanoqwen.random_model import PRESETS

    def last_wave_fills(tiles, hidden, splits, sms):
        per_wave = sms * resident_blocks(splits, gate_up_registers(), gate_up_block_shared_bytes(splits, hidden, 128))
        return tiles <= per_wave or tiles % per_wave == 0 or tiles % per_wave >= LAST_WAVE_MIN_FILL * per_wave

    assert gate_up_registers() == 96
    for intermediate in (16, 640, 4864, 11008, 18944, 27648, 100000):
        for groups in (1, 3, 7, 16, 28, 40, 128):
            for sms in (8, 114, 132):
                splits = gate_up_splits(intermediate, groups * 128, sms)
                most = max(1, min(GATE_UP_MAX_SPLITS, groups // GATE_UP_MIN_GROUPS_PER_SPLIT))
                tiles = -(-intermediate // 16)
                assert 1 <= splits <= most, (intermediate, groups, sms)
                assert splits == min(most, 2) or last_wave_fills(tiles, groups * 128, splits, sms)
                assert not any(last_wave_fills(tiles, groups * 128, more, sms) for more in range(splits + 1, most + 1))
    splits = {name.removeprefix("qwen2.5-coder-"): projection_splits("gate_up", *config.projection_shapes["gate_up"], 132)
              for name, config in PRESETS.items()}
    assert splits == {"0.5b": 3, "1.5b": 4, "3b": 3, "7b": 4, "14b": 4, "32b": 4}


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
