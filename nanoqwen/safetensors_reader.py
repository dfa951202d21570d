"""A minimal reader for Hugging Face safetensors checkpoints, one tensor at a time.

A .safetensors file is an 8-byte little-endian header length, a JSON header mapping each
tensor name to {dtype, shape, data_offsets}, then the raw bytes. Reading a tensor is one seek
and one read, so converting a 15 GB checkpoint holds one tensor in memory, never the model.
We parse it ourselves because numpy has no bfloat16, the dtype Qwen2.5 ships in.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_NUMPY_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


class CheckpointError(ValueError):
    """A checkpoint that cannot be converted; the message names the file or tensor."""


class SafetensorsCheckpoint:
    """All tensors of a (possibly sharded) checkpoint directory, read lazily by name."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.directory}: no .safetensors files (and no model.safetensors.index.json)")
        self.entries: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        for file_name in files:
            path = self.directory / file_name
            if not path.exists():
                raise CheckpointError(f"{path}: shard named in the index is missing")
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            base = 8 + header_len
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                self.entries[name] = (path, info["dtype"], tuple(info["shape"]), base + start, end - start)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def _entry(self, name: str):
        if name not in self.entries:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {name!r}")
        return self.entries[name]

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
