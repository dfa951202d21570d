"""A minimal reader for Hugging Face safetensors checkpoints, one tensor at a time.

A .safetensors file is an 8-byte little-endian header length, a JSON header mapping each
tensor name to {dtype, shape, data_offsets}, then the raw bytes. Reading a tensor is one seek
and one read, so converting a 15 GB checkpoint holds one tensor in memory, never the model.
We parse it ourselves because numpy has no bfloat16, the dtype Qwen2.5 ships in.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from .errors import CheckpointError
from .jsonlimits import JSONLimitError, RepeatedKeyError, check_json_size, parse_json, read_json_file

_NUMPY_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}



SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(directory: Path) -> list[str]:
    """The .safetensors files of a checkpoint folder, chosen as transformers chooses them:
    model.safetensors alone where it exists (a stale index beside it is not read), else the shards
    model.safetensors.index.json names, else every .safetensors file in the folder."""
    if (directory / SINGLE_FILE).exists():
        return [SINGLE_FILE]
    index = directory / INDEX_FILE
    if index.exists():
        files = sorted(set(_read_index(index)))
        if not files:
            raise CheckpointError(f"{index}: 'weight_map' names no shard")
        return files
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no .safetensors files (and no {INDEX_FILE})")
    return files


class SafetensorsCheckpoint:
    """All tensors of a (possibly sharded) checkpoint directory, read lazily by name."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.entries: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        for file_name in checkpoint_files(self.directory):
            path = self.directory / file_name
            if not path.exists():
                raise CheckpointError(f"{path}: shard named in the index is missing")
            if not path.is_file():  # a FIFO would wait for a writer for ever
                raise CheckpointError(f"{path}: is not a regular file (a folder, FIFO, device or socket)")
            header = _read_header(path)
            twice = sorted(header.keys() & self.entries.keys())  # which copy a loader takes is its own choice
            if twice:
                raise CheckpointError(f"tensor {twice[0]!r} is stored twice, in {self.entries[twice[0]][0]} and {path}")
            self.entries.update(header)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def _entry(self, name: str):
        if name not in self.entries:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {name!r}")
        return self.entries[name]

    def same_values(self, first: str, second: str, chunk_bytes: int = 64 << 20) -> bool:
        """Whether two tensors hold the same values; of one dtype and shape they are compared as
        stored, a chunk at a time, so that neither is read whole."""
        (path_a, dtype_a, shape_a, offset_a, nbytes_a), (path_b, dtype_b, shape_b, offset_b, nbytes_b) = (
            self._entry(first), self._entry(second))
        if shape_a != shape_b:
            return False
        if dtype_a != dtype_b or nbytes_a != nbytes_b:
            return bool(np.array_equal(self.read(first), self.read(second)))
        with open(path_a, "rb") as a, open(path_b, "rb") as b:
            a.seek(offset_a)
            b.seek(offset_b)
            for start in range(0, nbytes_a, chunk_bytes):
                size = min(chunk_bytes, nbytes_a - start)
                if a.read(size) != b.read(size):
                    return False
        return True

    def read(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        """One tensor as float32, checked against `expected_shape` when given."""
        path, dtype, shape, offset, nbytes = self._entry(name)
        if expected_shape is not None and shape != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {list(shape)}, the configuration requires {list(expected_shape)}"
            )
        if dtype not in _NUMPY_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {dtype}; only F32, F16 and BF16 are supported")
        np_dtype = _NUMPY_DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        if count * np_dtype.itemsize != nbytes:
            raise CheckpointError(f"tensor {name!r}: {nbytes} bytes do not match shape {list(shape)} of {dtype}")
        raw = np.fromfile(path, dtype=np_dtype, count=count, offset=offset)
        if raw.size != count:
            raise CheckpointError(f"tensor {name!r}: {path} is truncated")
        if dtype == "BF16":  # bfloat16 is the top half of a float32
            widened = raw.astype(np.uint32)
            del raw
            widened <<= 16  # in place: a second float32-sized temporary would double the peak
            return widened.view(np.float32).reshape(shape)
        return raw.astype(np.float32).reshape(shape)


def _read_index(path: Path) -> list[str]:
    """The shard file names of a model.safetensors.index.json."""
    try:
        weight_map = parse_json(read_json_file(path))["weight_map"]
    except (ValueError, KeyError, TypeError) as e:  # bad or oversized JSON, no weight_map, not an object
        raise CheckpointError(f"{path}: not a safetensors index with a 'weight_map' ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) and "/" not in f for f in weight_map.values()):
        raise CheckpointError(f"{path}: 'weight_map' must map tensor names to shard file names in this folder")
    return list(weight_map.values())


def _read_header(path: Path) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
    """name -> (path, dtype, shape, file offset, nbytes) for every tensor of one .safetensors file.

    Every length and offset is checked against the file's size before it is used, so a corrupt
    header can neither make us allocate its claimed length nor point a tensor outside the file.
    As the safetensors library requires, no name appears twice and the tensors' byte ranges tile
    the data exactly: from its first byte to its last, none overlapping another, no byte left over.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file (8-byte header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise CheckpointError(f"{path}: header length {header_len} exceeds the file's {size - 8} bytes after it")
        try:
            check_json_size(header_len)
            header = parse_json(f.read(header_len), unique_keys=True)
        except (JSONLimitError, RepeatedKeyError) as e:
            raise CheckpointError(f"{path}: header {e}") from None
        except ValueError as e:  # invalid JSON or UTF-8
            raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    base, data_bytes = 8 + header_len, size - 8 - header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} needs 'dtype', 'shape' and 'data_offsets' [start, end], "
                                  f"got {info!r:.120}") from None
        integers = [*shape, start, end] if isinstance(shape, list) else None
        if (not isinstance(dtype, str) or integers is None
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in integers)):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed entry {info!r:.120}")
        if not start <= end <= data_bytes:
            raise CheckpointError(f"{path}: tensor {name!r} bytes [{start}, {end}) lie outside the {data_bytes}-byte data")
        entries[name] = (path, dtype, tuple(shape), base + start, end - start)
    covered = 0
    for name, (*_, offset, nbytes) in sorted(entries.items(), key=lambda item: (item[1][3], item[1][4])):
        if offset - base != covered:
            what = "overlap the tensor before them" if offset - base < covered else f"leave bytes [{covered}, {offset - base}) unused"
            raise CheckpointError(f"{path}: the bytes [{offset - base}, {offset - base + nbytes}) of tensor {name!r} {what}")
        covered += nbytes
    if covered != data_bytes:
        raise CheckpointError(f"{path}: the tensors' bytes end at {covered}, the file's data at {data_bytes}")
    return entries
