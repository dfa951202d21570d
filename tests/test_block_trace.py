"""tools/block_trace.py's arithmetic on made-up block records, and the kernels' build with them."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
from conftest import load_tool

block_trace = load_tool("block_trace")
NUMBER = {name: number for number, name in block_trace.TRACED.items()}


def packed(kernel: int, sm: int, started: int, waited: int, finished: int) -> list[int]:
    """One record as trace_block_done writes it (kernels/common.cuh)."""
    return [kernel << block_trace.KERNEL_SHIFT | sm, started, waited, finished]


def test_records_unpack_as_the_kernels_pack_them():
    words = np.array([packed(5, 131, 10, 20, 30), packed(2, 7, 1, 2, 3)], dtype=np.uint64)
    records = block_trace.decode_records(words)
    assert records["kernel"].tolist() == [5, 2]
    assert records["sm"].tolist() == [131, 7]
    assert records["finished"].tolist() == [30, 3]


def two_layers(o_sms: list[int], combine_sms: list[int]) -> dict[str, np.ndarray]:
    """A step of two layers: the combine's blocks, then o's on `o_sms`, o starting 5 µs before its
    wait returns and finishing 3 to 7 µs after it; the second layer 100 µs later."""
    o, combine = NUMBER["gemv_int4_from_q_dim"], NUMBER["paged_attention_combine"]
    rows = []
    for layer in range(2):
        base = layer * 100_000
        rows += [packed(combine, sm, base, base + 1_000, base + 4_000) for sm in combine_sms]
        wait = base + 6_000
        rows += [packed(o, sm, wait - 5_000 + b, wait + b % 3, wait + 3_000 + 1_000 * (b % 5))
                 for b, sm in enumerate(o_sms)]
    rng = np.random.default_rng(0)
    return block_trace.decode_records(np.array(rng.permutation(rows), dtype=np.uint64))  # in no order, as atomics take slots


def test_each_kernel_is_summarized_per_launch_in_step_order():
    o_sms = [0, 0, 0, 0, 1, 1, 2, 3, 4, 5]  # four on SM 0
    rows = block_trace.summarize_blocks([two_layers(o_sms, combine_sms=[6, 7])], per_step=2)
    assert [r["kernel"] for r in rows] == ["paged_attention_combine", "gemv_int4_from_q_dim"]
    o = rows[1]
    assert o["blocks"] == 10 and o["sms"] == 6 and o["most_on_one_sm"] == 4
    assert o["head_start_us"] == pytest.approx(5.0)
    finished = [3 + b % 5 for b in range(10)]
    assert o["last_finished_us"] == pytest.approx(7.0)
    assert o["median_finished_us"] == pytest.approx(np.median(finished))


def test_launches_of_unequal_blocks_are_refused():
    records = two_layers([0, 1, 2], combine_sms=[3])
    keep = np.ones(len(records["kernel"]), bool)
    keep[np.flatnonzero(records["kernel"] == NUMBER["gemv_int4_from_q_dim"])[0]] = False
    with pytest.raises(RuntimeError, match="equal launches"):
        block_trace.launches({k: v[keep] for k, v in records.items()}, NUMBER["gemv_int4_from_q_dim"], 2)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_block_trace_keeps_the_decode_kernels_registers(tmp_path):
    """Built with NQ_TRACE_BLOCKS, the step's kernels compile with the registers of the engine's
    build and no spills, so the traced step runs the engine's occupancy (up to the 16 bytes of
    shared memory a block)."""
    from nanoqwen.cuda.build import kernel_dir, nvcc_command
    from nanoqwen.random_model import PRESETS

    entry = re.compile(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers", re.S)

    def registers(source: str, defines: dict) -> dict[str, tuple[int, int]]:
        command = nvcc_command(PRESETS["qwen2.5-coder-14b"], kernel_dir() / source, tmp_path / "k.cubin", defines)
        log = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stderr
        return {name: (int(spills), int(used)) for name, spills, used in entry.findall(log)}

    traced_kernels = set(block_trace.TRACED.values())
    for source in ("gemv_int4.cu", "paged_attention.cu"):
        plain, traced = registers(source, {}), registers(source, {"NQ_TRACE_BLOCKS": "1"})
        found = traced_kernels & set(plain)
        assert found, f"{source} holds none of the traced kernels"
        for name in found:
            assert traced[name] == plain[name], f"{name}: (spill bytes, registers) {plain[name]} plain, {traced[name]} traced"
