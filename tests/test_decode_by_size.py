"""tools/decode_by_size.py's record on made-up rows: both forms of the step in the table, and a run
cut short marked as such."""

from conftest import load_tool

decode_by_size = load_tool("decode_by_size")


def made_up_record(complete: bool) -> dict:
    row = dict(model="7b", context=640, ms_per_token=1.8, ms_per_token_persistent=3.8,
               floor_ms=1.45, share_of_floor=1.45 / 1.8, peak_gpu_bytes=18 * 2**30, prefill_weights="cache",
               time_to_first_token_ms=14.5)
    return dict(date="2026-12-06 06:00 UTC", gpu="NVIDIA H100 80GB HBM3", commit="abc1234",
                command="python3 tools/decode_by_size.py --out results/decode-by-size-h100",
                read_bandwidth_bytes_per_s=3.08e12, complete=complete, rows=[row])


def test_the_table_gives_both_forms_of_the_step_against_the_floor():
    text = decode_by_size.markdown(made_up_record(complete=True))
    header, _, row = text.strip().splitlines()[-3:]
    assert header.count("|") == row.count("|") == 10
    assert "| 7b | 640 | 1.800 | 1.450 | 80.6% | 3.800 ms (38.2%) | 14.5 ms | 18.0 GiB | cache |" == row
    assert "incomplete" not in text


def test_a_run_cut_short_says_so():
    assert "**incomplete**" in decode_by_size.markdown(made_up_record(complete=False))
