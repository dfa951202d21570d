"""Corrupt real .nanoqwen files every way we can think of; `load` must answer each one with
NanoqwenFormatError: never another exception, a hang, a large allocation or a read past the end.

Two kinds of corruption:
- blind ones (truncation, appended bytes, flipped bits) that the header checksum or the size
  check catches first;
- deliberate ones that recompute the header checksum (`with_checksum`), so the checks *after*
  it are reached: offsets, sizes, dtypes, shapes and names that lie.
"""

import gc
import math
import os
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import nanoqwen
from nanoqwen import ModelConfig, NanoqwenFormatError
from nanoqwen.format import ALIGNMENT, DTYPES, HEADER_BYTES, HEADER_DTYPE, RECORD_BYTES, RECORD_DTYPE, header_checksum
from nanoqwen.random_model import write_random_model

CONFIG = ModelConfig(
    num_layers=1, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1, head_dim=64,
    vocab_size=96, max_position_embeddings=64, rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A valid file (with tokenizer blobs, so every dtype code occurs) and a path to corrupt into."""
    directory = tmp_path_factory.mktemp("fuzz")
    (directory / "tok").mkdir()
    (directory / "tok" / "tokenizer.json").write_bytes(b'{"model": {}}')
    (directory / "tok" / "tokenizer_config.json").write_bytes(b"{}")
    path = write_random_model(directory / "valid.nanoqwen", CONFIG, seed=11, tokenizer_dir=directory / "tok")
    return path.read_bytes(), directory / "corrupt.nanoqwen"


def parse(data: bytes):
    header = np.frombuffer(data, HEADER_DTYPE, count=1)[0].copy()
    table = np.frombuffer(data, RECORD_DTYPE, count=int(header["tensor_count"]), offset=HEADER_BYTES).copy()
    return header, table


def with_checksum(data: bytes, header: np.ndarray, table: np.ndarray) -> bytes:
    """`data` with `header` and `table` written over it and the header checksum made right again,
    as a buggy or malicious writer would, so that validation beyond the checksum runs. The
    checksum covers the table the loader will read: `tensor_count` records from offset 256."""
    body = bytearray(data)
    body[HEADER_BYTES : HEADER_BYTES + table.nbytes] = table.tobytes()
    count = int(header["tensor_count"])
    if HEADER_BYTES + RECORD_BYTES * count <= len(body):
        table = np.frombuffer(bytes(body), RECORD_DTYPE, count=count, offset=HEADER_BYTES)
    header = header.copy()
    header["checksum"] = header_checksum(header, table)
    body[:HEADER_BYTES] = header.tobytes()
    return bytes(body)


def assert_rejected(path, data: bytes, match: str | None = None, verify_checksums: bool = False) -> str:
    """Write `data`, load it, demand NanoqwenFormatError within 1 s and 2 MB of Python allocations."""
    path.write_bytes(data)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(NanoqwenFormatError, match=match) as error:
            nanoqwen.load(path, verify_checksums=verify_checksums)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0, f"rejecting took {elapsed:.2f} s"
    assert peak < 2 * 2**20, f"rejecting allocated {peak} bytes"
    assert str(path) in str(error.value)  # the message names the file
    return str(error.value)


def test_original_loads_and_the_checksum_helper_is_neutral(original):
    data, path = original
    path.write_bytes(with_checksum(data, *parse(data)))
    assert path.read_bytes() == data
    model = nanoqwen.load(path, verify_checksums=True)
    assert set(model.tokenizer_files) == {"tokenizer.json", "tokenizer_config.json"}


# --- blind corruption ---------------------------------------------------------------------


@FUZZ
@given(st.data())
def test_truncation_at_any_length(original, data):
    raw, path = original
    length = data.draw(st.integers(0, len(raw) - 1))
    message = assert_rejected(path, raw[:length])
    assert "shorter than the 256-byte header" in message or "truncated or extended" in message


@FUZZ
@given(st.binary(min_size=1, max_size=4096))
def test_appended_bytes(original, tail):
    raw, path = original
    assert_rejected(path, raw + tail, match="truncated or extended")


@FUZZ
@given(st.data())
def test_flipped_bits_in_header_and_table(original, data):
    raw, path = original
    table_end = HEADER_BYTES + RECORD_BYTES * int(parse(raw)[0]["tensor_count"])
    # CRC-32 detects every error of up to 3 bits in messages this short (Hamming distance >= 4)
    flips = data.draw(st.lists(st.tuples(st.integers(0, table_end - 1), st.integers(0, 7)), min_size=1, max_size=3))
    corrupt = bytearray(raw)
    for position, bit in flips:
        corrupt[position] ^= 1 << bit
    assume(bytes(corrupt) != raw)  # two flips of the same bit cancel
    assert_rejected(path, bytes(corrupt))


@FUZZ
@given(st.data())
def test_overwritten_bytes_in_header_and_table(original, data):
    raw, path = original
    table_end = HEADER_BYTES + RECORD_BYTES * int(parse(raw)[0]["tensor_count"])
    start = data.draw(st.integers(0, table_end - 1))
    junk = data.draw(st.binary(min_size=1, max_size=64))
    corrupt = raw[:start] + junk + raw[start + len(junk) :]
    corrupt = corrupt[: len(raw)]
    assume(corrupt != raw)
    assert_rejected(path, corrupt)


@FUZZ
@given(st.data())
def test_flipped_bits_in_tensor_data_are_caught_by_verify_checksums(original, data):
    raw, path = original
    _, table = parse(raw)
    record = table[data.draw(st.integers(0, len(table) - 1))]
    position = int(record["offset"]) + data.draw(st.integers(0, int(record["nbytes"]) - 1))
    corrupt = bytearray(raw)
    corrupt[position] ^= 1 << data.draw(st.integers(0, 7))
    path.write_bytes(bytes(corrupt))
    name = bytes(record["name"]).rstrip(b"\0").decode()
    message = f"tensor '{name}' fails its CRC-32"
    if name.startswith("tokenizer/"):  # small blobs, parsed at every load: checked at every load
        assert_rejected(path, bytes(corrupt), match=message)
    else:
        nanoqwen.load(path).close()  # structure intact: the cheap load does not read weight data
    assert_rejected(path, bytes(corrupt), match=message, verify_checksums=True)


@pytest.mark.parametrize("magic", [b"NANOQWEM", b"\0" * 8, b"GGUF\3\0\0\0", b"nanoqwen"])
def test_wrong_magic(original, magic):
    raw, path = original
    assert_rejected(path, magic + raw[8:], match="bad magic")
    header, table = parse(raw)
    header["magic"] = magic
    assert_rejected(path, with_checksum(raw, header, table), match="bad magic")


@FUZZ
@given(U32.filter(lambda v: v != 1))
def test_wrong_version(original, version):
    raw, path = original
    header, table = parse(raw)
    header["version"] = version
    assert_rejected(path, with_checksum(raw, header, table), match=f"format version {version} is not supported")


def test_a_sparse_file_cannot_declare_a_table_of_billions_of_tensors(original, tmp_path):
    """The table is copied before anything else is trusted: its size is capped, not left to
    file_size, which a sparse file can make as large as the count asks for."""
    raw, _ = original
    header, _ = parse(raw)
    header["tensor_count"] = 2**32 - 1
    header["data_offset"] = header["file_size"] = HEADER_BYTES + RECORD_BYTES * (2**32 - 1) + ALIGNMENT
    path = tmp_path / "sparse.nanoqwen"
    with open(path, "wb") as f:
        f.write(header.tobytes() + raw[HEADER_BYTES:4096])
        f.truncate(int(header["file_size"]))  # 512 GiB that occupy a few kilobytes of disk
    tracemalloc.start()
    try:
        with pytest.raises(NanoqwenFormatError, match="tensor_count 4,294,967,295 is more than the 65,536"):
            nanoqwen.load(path)
        assert tracemalloc.get_traced_memory()[1] < 2_000_000
    finally:
        tracemalloc.stop()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_a_fifo_or_a_folder_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "m.nanoqwen"
    os.mkfifo(fifo)  # opening it plainly would wait for a writer for ever
    for path in (fifo, tmp_path):
        with pytest.raises(NanoqwenFormatError, match="is not a regular file"):
            nanoqwen.load(path)


def test_not_a_nanoqwen_file_at_all(original, tmp_path):
    _, path = original
    assert_rejected(path, b"", match="shorter than the 256-byte header")
    assert_rejected(path, b"\x08\0\0\0\0\0\0\0{}      " + bytes(300), match="bad magic")  # a safetensors file


# --- deliberate corruption, checksum recomputed --------------------------------------------

HEADER_SIZES = ["header_bytes", "record_bytes", "tensor_count", "table_offset", "data_offset", "file_size"]


@FUZZ
@given(st.sampled_from(HEADER_SIZES), U64)
def test_header_sizes_and_offsets_that_lie(original, field, value):
    raw, path = original
    header, table = parse(raw)
    value %= 2 ** (8 * header[field].itemsize)
    assume(value != int(header[field]))
    if field == "data_offset":  # moving it inside the padding before the first tensor is harmless
        table_end = HEADER_BYTES + RECORD_BYTES * len(table)
        assume(not table_end <= value <= int(table["offset"].min()))
    if field == "tensor_count":  # dropping only the (optional) tokenizer blobs at the end is harmless
        required = sum(not bytes(name).startswith(b"tokenizer/") for name in table["name"])
        assume(not required <= value < len(table))
    header[field] = value
    assert_rejected(path, with_checksum(raw, header, table))


STRUCTURAL_FIELDS = [
    "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
    "vocab_size", "group_size", "tie_word_embeddings",
]


@FUZZ
@given(st.sampled_from(STRUCTURAL_FIELDS), st.one_of(st.integers(0, 4096), U32))
def test_configuration_inconsistent_with_the_tensors(original, field, value):
    """Any other value of a field that shapes a tensor contradicts the table (or is invalid)."""
    raw, path = original
    header, table = parse(raw)
    assume(value != int(header[field]))
    header[field] = value
    message = assert_rejected(path, with_checksum(raw, header, table))
    assert any(word in message for word in ("configuration", "num_layers", "missing tensor", "unexpected tensor"))


@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps"])
@pytest.mark.parametrize("value", [0.0, -1.0, np.inf, -np.inf, np.nan])
def test_invalid_float_parameters(original, field, value):
    raw, path = original
    header, table = parse(raw)
    header[field] = value
    assert_rejected(path, with_checksum(raw, header, table), match="invalid model configuration")


def test_huge_layer_count_is_refused_without_enumerating_layers(original):
    raw, path = original
    header, table = parse(raw)
    header["num_layers"] = 2**32 - 1
    assert_rejected(path, with_checksum(raw, header, table), match="cannot fit in a table")


def record_strategy(raw):
    return st.integers(0, int(parse(raw)[0]["tensor_count"]) - 1)


@FUZZ
@given(st.data())
def test_huge_offsets(original, data):
    raw, path = original
    header, table = parse(raw)
    i = data.draw(record_strategy(raw))
    table[i]["offset"] = data.draw(st.integers(len(raw) - int(table[i]["nbytes"]) + 1, 2**64 - 1))
    assert_rejected(path, with_checksum(raw, header, table))


@FUZZ
@given(st.data())
def test_misaligned_offsets(original, data):
    raw, path = original
    header, table = parse(raw)
    i = data.draw(record_strategy(raw))
    table[i]["offset"] = int(table[i]["offset"]) + data.draw(st.integers(1, ALIGNMENT - 1))
    assert_rejected(path, with_checksum(raw, header, table), match=f"offset {int(table[i]['offset'])} is not 128-byte aligned")


@FUZZ
@given(st.data())
def test_overlapping_offsets(original, data):
    raw, path = original
    header, table = parse(raw)
    i, j = data.draw(st.lists(record_strategy(raw), min_size=2, max_size=2, unique=True))
    # start tensor i inside tensor j, on an aligned byte, staying inside the file
    room = (int(table[j]["nbytes"]) - 1) // ALIGNMENT
    table[i]["offset"] = int(table[j]["offset"]) + ALIGNMENT * data.draw(st.integers(0, room))
    assume(int(table[i]["offset"] + table[i]["nbytes"]) <= len(raw))
    assert_rejected(path, with_checksum(raw, header, table), match="overlap")


@FUZZ
@given(st.data())
def test_offsets_into_the_header_or_table(original, data):
    raw, path = original
    header, table = parse(raw)
    i = data.draw(record_strategy(raw))
    table[i]["offset"] = ALIGNMENT * data.draw(st.integers(0, int(header["data_offset"]) // ALIGNMENT - 1))
    assert_rejected(path, with_checksum(raw, header, table), match="outside the data region")


@FUZZ
@given(st.data())
def test_sizes_that_disagree_with_the_shape(original, data):
    raw, path = original
    header, table = parse(raw)
    i = data.draw(record_strategy(raw))
    nbytes = data.draw(U64.filter(lambda n: n != int(table[i]["nbytes"])))
    table[i]["nbytes"] = nbytes
    assert_rejected(path, with_checksum(raw, header, table), match="does not match shape")


@FUZZ
@given(st.data())
def test_wrong_dtype_codes(original, data):
    raw, path = original
    header, table = parse(raw)
    i = data.draw(record_strategy(raw))
    old_code = int(table[i]["dtype"])
    code = data.draw(st.one_of(st.sampled_from(sorted(DTYPES)), U32).filter(lambda c: c != old_code))
    table[i]["dtype"] = code
    if code in DTYPES and data.draw(st.booleans()):  # keep nbytes consistent: the dtype itself must be caught
        table[i]["nbytes"] = int(table[i]["nbytes"]) // DTYPES[old_code].itemsize * DTYPES[code].itemsize
    message = assert_rejected(path, with_checksum(raw, header, table))
    words = ("dtype", "does not match shape", "configuration requires", "unexpected tensor", "outside the data region", "overlap")
    assert any(word in message for word in words), message


@FUZZ
@given(st.data())
def test_shapes_inconsistent_with_the_config(original, data):
    raw, path = original
    header, table = parse(raw)
    i = data.draw(record_strategy(raw))
    record = table[i]
    ndim = int(record["ndim"])
    old_shape = tuple(int(d) for d in record["shape"][:ndim])
    new_ndim = data.draw(st.integers(1, 4))
    new_shape = tuple(data.draw(st.lists(st.integers(1, 2**20), min_size=new_ndim, max_size=new_ndim)))
    assume(new_shape != old_shape)
    keep_nbytes = data.draw(st.booleans())  # then only the configuration check can object
    # a tokenizer blob may have any length: a shorter 1-D blob of consistent size is a valid file
    assume(not (bytes(record["name"]).startswith(b"tokenizer/") and new_ndim == 1 and keep_nbytes))
    record["ndim"] = new_ndim
    record["shape"] = new_shape + (0,) * (4 - new_ndim)
    if keep_nbytes:
        record["nbytes"] = math.prod(new_shape) * DTYPES[int(record["dtype"])].itemsize % 2**64
    assert_rejected(path, with_checksum(raw, header, table))


@pytest.mark.parametrize("ndim", [0, 5, 2**32 - 1])
def test_ndim_outside_range(original, ndim):
    raw, path = original
    header, table = parse(raw)
    table[0]["ndim"] = ndim
    assert_rejected(path, with_checksum(raw, header, table), match=f"ndim {ndim} outside")


def test_nonzero_unused_dimension_and_zero_dimension(original):
    raw, path = original
    header, table = parse(raw)
    i = int(np.flatnonzero(table["ndim"] == 1)[0])
    table[i]["shape"][3] = 1
    assert_rejected(path, with_checksum(raw, header, table), match="bad shape")
    header, table = parse(raw)
    table[0]["shape"][0] = 0
    assert_rejected(path, with_checksum(raw, header, table), match="bad shape")


@FUZZ
@given(st.data())
def test_names_that_lie(original, data):
    raw, path = original
    header, table = parse(raw)
    names = [bytes(r["name"]).rstrip(b"\0") for r in table]
    i = data.draw(st.integers(0, len(table) - 1))
    kind = data.draw(st.sampled_from(["duplicate", "empty", "non-ascii", "random"]))
    if kind == "duplicate":
        new = data.draw(st.sampled_from([n for n in names if n != names[i]]))
    elif kind == "empty":
        new = b""
    elif kind == "non-ascii":
        new = names[i][:10] + bytes([data.draw(st.integers(128, 255))]) + names[i][11:]
    else:
        new = data.draw(st.binary(min_size=1, max_size=64).filter(lambda n: n.rstrip(b"\0") not in names))
    table[i]["name"] = new
    message = assert_rejected(path, with_checksum(raw, header, table))
    assert any(word in message for word in ("name", "missing tensor", "unexpected tensor"))


@pytest.mark.parametrize("name", [b"tokenizer/\x1b[2J\x1b[31mOK", b"tokenizer/a\nchecksums fine", b"tokenizer/a\x00b"])
def test_a_name_with_control_characters_is_refused(original, name):
    """inspect prints names: a file must not be able to write escape sequences to a terminal."""
    raw, path = original
    header, table = parse(raw)
    i = [bytes(r["name"]).startswith(b"tokenizer/") for r in table].index(True)
    table[i]["name"] = name
    assert_rejected(path, with_checksum(raw, header, table), match="a name with control characters")


def test_tokenizer_blob_must_be_u8_and_one_dimensional(original):
    raw, path = original
    header, table = parse(raw)
    i = [bytes(r["name"]).startswith(b"tokenizer/") for r in table].index(True)
    table[i]["dtype"] = 1  # f16
    table[i]["nbytes"] = 2 * int(table[i]["shape"][0])
    assert int(table[i]["offset"] + table[i]["nbytes"]) <= int(table[i + 1]["offset"])  # fits its padding
    assert_rejected(path, with_checksum(raw, header, table), match="unexpected tensor 'tokenizer/")


@pytest.mark.parametrize("name", [b"tokenizer/vocab.json", b"tokenizer/../tokenizer/tokenizer.json", b"tokenizer/"])
def test_a_tokenizer_blob_of_no_known_file_is_refused(original, name):
    """Only the four files a tokenizer reads may ride along: any number of other blobs, each up to
    MAX_JSON_BYTES and sparse on disk, would be checked and copied at every load."""
    raw, path = original
    header, table = parse(raw)
    i = [bytes(r["name"]).startswith(b"tokenizer/") for r in table].index(True)
    table[i]["name"] = name
    assert_rejected(path, with_checksum(raw, header, table), match="unexpected tensor 'tokenizer/")


def test_rejected_file_leaves_no_mapping_behind(original):
    raw, path = original
    header, table = parse(raw)
    table[0]["offset"] += 1
    path.write_bytes(with_checksum(raw, header, table))
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux) to count memory maps")
    for _ in range(20):
        with pytest.raises(NanoqwenFormatError):
            nanoqwen.load(path)
    # Earlier tests may still hold (unreferenced, uncollected) models of a file at this path.
    gc.collect()
    assert str(path) not in maps.read_text()
    model = nanoqwen.load(path.with_name("valid.nanoqwen"))
    assert str(model.path) in maps.read_text()  # the check above can see a live map
    model.close()
