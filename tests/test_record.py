"""tools/record.py: a record names the command that makes it again, writing where results/ keeps it."""

from pathlib import Path

from conftest import load_tool

record = load_tool("record")


def test_the_command_writes_to_results_under_the_name_given():
    assert (record.record_command("tools/decode_by_size.py", Path("/tmp/out/decode-by-size-h100"), "--sizes", "7b")
            == "python3 tools/decode_by_size.py --sizes 7b --out results/decode-by-size-h100")
    assert (record.record_command("tools/sanitize_engine.py", Path("sanitizer-engine-h100.json"), out_flag="--json")
            == "python3 tools/sanitize_engine.py --json results/sanitizer-engine-h100.json")
