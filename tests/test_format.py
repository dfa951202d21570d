"""The .nanoqwen v1 layout, the streaming writer, the loaded Model, and random-weight files."""

import re
from pathlib import Path

import numpy as np
import pytest

import nanoqwen
from nanoqwen import ModelConfig, NanoqwenFormatError
from nanoqwen.format import (
    ALIGNMENT,
    DTYPE_NAMES,
    DTYPES,
    HEADER_BYTES,
    HEADER_DTYPE,
    MAGIC,
    RECORD_BYTES,
    RECORD_DTYPE,
    NanoqwenWriter,
    header_checksum,
    plan_layout,
)
from nanoqwen.quant import unpack_int4
from nanoqwen.random_model import QWEN25_CODER_7B, TYPICAL_SCALE, write_random_model

SPEC = Path(__file__).resolve().parents[1] / "book" / "format-spec.md"

TINY = ModelConfig(
    num_layers=2, hidden_size=256, intermediate_size=384, num_heads=4, num_kv_heads=2, head_dim=64,
    vocab_size=300, max_position_embeddings=128, rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
TINY_TIED = ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": True})


def spec_table(heading: str) -> list[tuple[int, int, str]]:
    """(offset, size, field) rows of the table under `## heading` in the specification page."""
    section = SPEC.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [(int(o), int(n), f) for o, n, f in re.findall(r"^\| (\d+) \| (\d+) \| `(\w+)` \|", section, re.M)]


@pytest.mark.parametrize("heading, dtype", [("Header", HEADER_DTYPE), ("Tensor record", RECORD_DTYPE)])
def test_specification_tables_match_the_code(heading, dtype):
    rows = spec_table(heading)
    code = [(dtype.fields[name][1], dtype.fields[name][0].itemsize, name) for name in dtype.names]
    assert rows == code
    assert sum(size for _, size, _ in rows) == {"Header": HEADER_BYTES, "Tensor record": RECORD_BYTES}[heading]


def test_specification_dtype_codes_match_the_code():
    section = SPEC.read_text().split("## Dtype codes\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (\d+) \|", section, re.M)
    assert {int(c): (n, int(b)) for c, n, b in rows} == {c: (DTYPE_NAMES[c], DTYPES[c].itemsize) for c in DTYPES}


def test_specification_tensor_list_matches_tensor_specs():
    section = SPEC.read_text().split("## Tensors\n", 1)[1].split("\n## ", 1)[0]
    listed = {name.replace("{i}", "0"): dtype for name, dtype in re.findall(r"^\| `([\w.{}]+)` \| (\w+) \|", section, re.M)}
    specs = {name: dtype for name, (dtype, _) in TINY.tensor_specs().items() if not name.startswith("model.layers.1.")}
    assert listed == specs


def test_specification_tokenizer_limits_match_the_code():
    import importlib

    section = SPEC.read_text().split("### What a reader may trust in them\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| [^|]+ \| (\d+) \| `([\w.]+)\.(\w+)` \|", section, re.M)
    assert len(rows) == 6
    for value, module, name in rows:
        assert getattr(importlib.import_module(module), name) == int(value), name


def test_layout_is_aligned_and_contiguous():
    entries = [(n, d, s) for n, (d, s) in TINY.tensor_specs().items()] + [("tokenizer/x.json", "u8", (77,))]
    table, data_offset, file_size = plan_layout(entries)
    assert data_offset == -(-(HEADER_BYTES + RECORD_BYTES * len(entries)) // ALIGNMENT) * ALIGNMENT
    end = data_offset
    for record in table:
        assert record["offset"] % ALIGNMENT == 0
        assert record["offset"] == -(-end // ALIGNMENT) * ALIGNMENT  # next aligned byte after the previous
        end = int(record["offset"] + record["nbytes"])
    assert file_size == -(-end // ALIGNMENT) * ALIGNMENT


@pytest.mark.parametrize(
    "entries, match",
    [
        ([("a", "f16", (2,)), ("a", "f16", (2,))], "duplicated"),
        ([("", "f16", (2,))], "empty"),
        ([("x" * 65, "f16", (2,))], "longer than 64"),
        ([("a", "f16", (2, 0))], "unsupported shape"),
        ([("a", "f16", (1, 1, 1, 1, 1))], "unsupported shape"),
    ],
)
def test_layout_refuses_bad_entries(entries, match):
    with pytest.raises(ValueError, match=match):
        plan_layout(entries)


def test_written_file_has_the_specified_bytes(tmp_path):
    path = write_random_model(tmp_path / "m.nanoqwen", TINY, seed=3)
    data = path.read_bytes()
    header = np.frombuffer(data, HEADER_DTYPE, count=1)[0]
    assert data[:8] == MAGIC == b"NANOQWEN"
    assert int.from_bytes(data[8:12], "little") == 1
    assert int(header["file_size"]) == len(data) and len(data) % ALIGNMENT == 0
    assert not any(bytes(header["reserved"]))
    table = np.frombuffer(data, RECORD_DTYPE, count=int(header["tensor_count"]), offset=HEADER_BYTES)
    assert header_checksum(header, table) == int(header["checksum"])
    # data_offset is the first aligned byte after the table, and the gap is zero padding
    table_end = HEADER_BYTES + RECORD_BYTES * len(table)
    assert int(header["data_offset"]) == -(-table_end // ALIGNMENT) * ALIGNMENT
    assert not any(data[table_end : int(header["data_offset"])])


def test_writer_refuses_unknown_duplicate_and_misshaped_tensors(tmp_path):
    entries = [("a", "f16", (4,)), ("b", "u32", (2, 2))]
    writer = NanoqwenWriter(tmp_path / "w.nanoqwen", TINY, entries)
    with pytest.raises(KeyError, match="'c' is not in this file's layout"):
        writer.write("c", np.zeros(4))
    with pytest.raises(ValueError, match=r"'b': expected shape \(2, 2\), got \(4,\)"):
        writer.write("b", np.zeros(4, np.uint32))
    writer.write("a", np.ones(4, np.float16))
    with pytest.raises(ValueError, match="'a' was already written"):
        writer.write("a", np.ones(4, np.float16))
    with pytest.raises(ValueError, match="never written, e.g. 'b'"):
        writer.close()
    assert list(tmp_path.iterdir()) == []  # close() on an incomplete file removed the .partial


def test_writer_leaves_nothing_when_the_block_raises(tmp_path):
    with pytest.raises(RuntimeError):
        with NanoqwenWriter(tmp_path / "w.nanoqwen", TINY, [("a", "f16", (4,))]) as writer:
            assert writer.partial.exists() and not writer.path.exists()
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_model_api_and_zero_copy_views(tmp_path):
    path = write_random_model(tmp_path / "m.nanoqwen", TINY, seed=4)
    model = nanoqwen.load(path, verify_checksums=True)
    assert model.config == TINY and model.path == path
    assert set(model.tensors) == set(TINY.tensor_specs())
    layer = model.layer(1)
    c = TINY
    assert layer.q.qweight.shape == (c.q_dim, c.hidden_size // 8) and layer.q.bias.shape == (c.q_dim,)
    assert layer.k.out_features == c.kv_dim and layer.k.in_features == c.hidden_size
    assert layer.o.in_features == c.q_dim and layer.o.bias is None
    assert layer.down.scales.shape == (c.hidden_size, c.intermediate_size // 128)
    assert layer.input_norm.dtype == np.float16 and layer.gate.qweight.dtype == np.uint32
    assert model.lm_head is model.tensors["lm_head.weight"]
    with pytest.raises(IndexError, match="layer 2 out of range"):
        model.layer(2)
    mapped = np.frombuffer(model._mmap, np.uint8)
    for name, array in model.tensors.items():  # every tensor borrows the one memory map
        assert not array.flags.writeable and not array.flags.owndata, name
        assert np.shares_memory(array, mapped), name
    del mapped
    assert model.nbytes == sum(int(np.prod(s)) * DTYPES[{"f16": 1, "u32": 3}[d]].itemsize for d, s in TINY.tensor_specs().values())
    assert "layers=2" in repr(model)
    model.close()


def test_tied_model_has_no_lm_head_tensor(tmp_path):
    model = nanoqwen.load(write_random_model(tmp_path / "t.nanoqwen", TINY_TIED))
    assert "lm_head.weight" not in model.tensors
    assert model.lm_head is model.embed


def test_load_refuses_missing_path_and_directory(tmp_path):
    with pytest.raises(NanoqwenFormatError, match="cannot open"):
        nanoqwen.load(tmp_path / "absent.nanoqwen")
    with pytest.raises(NanoqwenFormatError, match="is not a regular file"):
        nanoqwen.load(tmp_path)


def test_random_model_values_are_plausible(tmp_path):
    model = nanoqwen.load(write_random_model(tmp_path / "r.nanoqwen", TINY, seed=5), verify_checksums=True)
    q = unpack_int4(model.layer(0).gate.qweight)
    counts = np.bincount((q + 8).ravel(), minlength=16)
    assert counts[0] == 0, "nibble 0 (q = -8) is never stored"
    assert (counts[1:] > 0).all()
    scales = model.layer(1).down.scales.astype(np.float32)
    assert (scales > 0).all() and 0.5 * TYPICAL_SCALE < np.median(scales) < 2 * TYPICAL_SCALE
    assert abs(float(model.embed.astype(np.float32).std()) - 0.02) < 0.002
    assert abs(float(model.final_norm.astype(np.float32).mean()) - 1.0) < 0.05
    assert np.isfinite(model.lm_head.astype(np.float32)).all()


def test_random_model_depends_on_the_seed_not_the_thread_count(tmp_path, monkeypatch):
    import nanoqwen.random_model as random_model

    monkeypatch.setattr(random_model, "CHUNK_ELEMENTS", 1 << 12)  # several chunks per tensor
    files = {}
    for threads in (1, 4):
        monkeypatch.setattr(random_model.os, "cpu_count", lambda: threads)
        files[threads] = write_random_model(tmp_path / f"{threads}.nanoqwen", TINY, seed=7).read_bytes()
    other_seed = write_random_model(tmp_path / "other.nanoqwen", TINY, seed=8).read_bytes()
    assert files[1] == files[4]
    assert len(other_seed) == len(files[1]) and other_seed != files[1]


def test_random_model_carries_tokenizer_files(tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes(b'{"model": {"type": "BPE"}}')
    (tmp_path / "tok" / "tokenizer_config.json").write_bytes(b'{"chat_template": "\xe2\x9c\x93"}')
    model = nanoqwen.load(write_random_model(tmp_path / "m.nanoqwen", TINY, tokenizer_dir=tmp_path / "tok"))
    assert model.tokenizer_files == {
        "tokenizer.json": b'{"model": {"type": "BPE"}}',
        "tokenizer_config.json": b'{"chat_template": "\xe2\x9c\x93"}',
    }
    assert model.tensors["tokenizer/tokenizer.json"].dtype == np.uint8
    with pytest.raises(FileNotFoundError, match="tokenizer_dir must hold"):
        write_random_model(tmp_path / "n.nanoqwen", TINY, tokenizer_dir=tmp_path)
    assert not (tmp_path / "n.nanoqwen.partial").exists()


def test_a_folder_the_writer_cannot_write_is_named(tmp_path, monkeypatch):
    """The error names OUT's folder, not the temporary file's random name."""
    import errno

    from nanoqwen import format as format_module

    def refused(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(format_module.os, "open", refused)
    with pytest.raises(PermissionError, match=f"cannot create m.nanoqwen in {tmp_path} .Permission denied") as error:
        write_random_model(tmp_path / "m.nanoqwen", TINY)
    assert ".partial" not in str(error.value)


def test_random_model_cli(tmp_path, monkeypatch, capsys):
    import nanoqwen.random_model as random_model

    monkeypatch.setitem(random_model.PRESETS, "tiny", TINY)
    random_model.main([str(tmp_path / "cli.nanoqwen"), "--preset", "tiny", "--seed", "2"])
    assert "cli.nanoqwen" in capsys.readouterr().out
    assert nanoqwen.load(tmp_path / "cli.nanoqwen").config == TINY


@pytest.mark.parametrize("argv, message", [
    (["{out}", "--preset", "tiny", "--layers", "0"], "num_layers must be a positive integer"),
    # counted, not built: a billion layers' tensor list would take minutes and gigabytes to refuse
    (["{out}", "--preset", "tiny", "--layers", "1000000000"], "layers make 19,000,000,003 tensors, more than the 65,536"),
    (["{out}", "--preset", "tiny", "--seed", "-1"], "--seed must be a non-negative integer"),
    (["{missing}/m.nanoqwen", "--preset", "tiny"], "does not exist"),
    (["{out}/", "--preset", "tiny"], "names a folder"),  # not a file named m.nanoqwen
])
def test_random_model_cli_errors_are_one_line(tmp_path, monkeypatch, capsys, argv, message):
    import nanoqwen.random_model as random_model

    monkeypatch.setitem(random_model.PRESETS, "tiny", TINY)
    with pytest.raises(SystemExit) as exit_info:
        random_model.main([a.format(out=tmp_path / "m.nanoqwen", missing=tmp_path / "missing") for a in argv])
    stderr = capsys.readouterr().err
    assert exit_info.value.code in (1, 2) and message in stderr and "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, data, message", [
    ("tokenizer.json", b"{not json", "tokenizer.json: "),
    ("chat_template.jinja", b"", "chat_template.jinja: is empty"),
])
def test_random_model_cli_checks_the_tokenizer_it_stores(tmp_path, monkeypatch, capsys, name, data, message):
    """As the converter checks a checkpoint's: a file the engine could not run is refused, not written."""
    import nanoqwen.random_model as random_model

    monkeypatch.setitem(random_model.PRESETS, "tiny", TINY)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes(b'{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}')
    (tok / "tokenizer_config.json").write_bytes(b"{}")
    (tok / name).write_bytes(data)
    with pytest.raises(SystemExit) as exit_info:
        random_model.main([str(tmp_path / "m.nanoqwen"), "--preset", "tiny", "--tokenizer-dir", str(tok)])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 1 and message in stderr and stderr.count("\n") == 1
    assert not list(tmp_path.glob("m.nanoqwen*"))


def test_7b_preset_byte_budget():
    """The 7B's tensors, in bytes, from its ModelConfig alone (no file)."""
    c = QWEN25_CODER_7B
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (28, 3584, 18944)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (28, 4, 128, 152064)
    specs = c.tensor_specs()
    nbytes = {n: int(np.prod(s)) * (4 if d == "u32" else 2) for n, (d, s) in specs.items()}
    assert len(specs) == 535
    assert sum(b for n, b in nbytes.items() if n.endswith(".qweight")) == 3_262_644_224
    assert sum(b for n, b in nbytes.items() if n.endswith(".scales")) == 101_957_632
    assert nbytes["lm_head.weight"] == nbytes["model.embed_tokens.weight"] == 1_089_994_752
    table, data_offset, file_size = plan_layout([(n, d, s) for n, (d, s) in specs.items()])
    assert (data_offset, file_size) == (68_736, 5_545_326_720)  # the figures in book/format-spec.md
    assert f"{file_size:,}" in SPEC.read_text()
