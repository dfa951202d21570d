"""Open a .nanoqwen file: memory-map it, validate every byte that locates data, hand out views.

Validation happens once, before any tensor is touched, and only with Python integers, so a
corrupt file can never make us allocate, seek or read past its end. After that, every tensor
is a read-only numpy view of the map: no copy, and the OS pages weights in on first touch.

Because the tensors are the file's pages, a loaded file must not be changed in place while a
Model (or an Engine) uses it: `cp` over it or a truncation changes the weights under a running
engine, or kills it with SIGBUS when it touches a page past the new end. Replace it the way
`nanoqwen convert` writes it, by renaming a complete new file over the old name: the old
file's pages stay mapped until it is closed.
"""

from __future__ import annotations

import mmap
import os
import stat
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import GROUP_SIZE, ModelConfig
from .errors import ConfigError, NanoqwenFormatError
from .format import (
    ALIGNMENT,
    CONFIG_FIELDS,
    DTYPE_NAMES,
    DTYPES,
    HEADER_BYTES,
    HEADER_DTYPE,
    MAGIC,
    MAX_NDIM,
    MAX_TENSORS,
    RECORD_BYTES,
    RECORD_DTYPE,
    VERSION,
    header_checksum,
)
from .jsonlimits import MAX_JSON_BYTES

TOKENIZER_PREFIX = "tokenizer/"
# The checkpoint files a .nanoqwen may carry as `tokenizer/<name>` blobs, and no others.
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"  # where transformers 5 saves the template, ahead of the config's
GENERATION_CONFIG_JSON = "generation_config.json"  # its eos_token_id: what transformers' generate stops at
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG_JSON, CHAT_TEMPLATE_JINJA, GENERATION_CONFIG_JSON)
TOKENIZER_BLOBS = frozenset(TOKENIZER_PREFIX + name for name in TOKENIZER_FILES)



@dataclass(frozen=True)
class Int4Linear:
    qweight: np.ndarray  # uint32 [out, in/8], interleaved nibbles (nanoqwen.quant)
    scales: np.ndarray  # float16 [out, in/group]
    bias: np.ndarray | None  # float16 [out] or None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 8


@dataclass(frozen=True)
class LayerWeights:
    input_norm: np.ndarray  # float16 [hidden]
    post_norm: np.ndarray  # float16 [hidden]
    q: Int4Linear
    k: Int4Linear
    v: Int4Linear
    o: Int4Linear
    gate: Int4Linear
    up: Int4Linear
    down: Int4Linear


class _ClosedTensors(Mapping):
    """A closed model's tensors: none, and a named error for any asked for by a reader (an engine
    sharing the model) that outlived the close."""

    def __init__(self, path: Path):
        self.path = path

    def __getitem__(self, name: str) -> np.ndarray:
        raise NanoqwenFormatError(f"{self.path}: the model is closed, so its tensor {name!r} is no longer mapped; "
                                  "load it again")

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


class Model:
    """A validated, memory-mapped .nanoqwen model. Build it with `nanoqwen.load`."""

    def __init__(self, path: Path, config: ModelConfig, tensors: Mapping[str, np.ndarray], mapping):
        self.path = path
        self.config = config
        self.tensors = tensors
        self._mmap = mapping  # the views borrow its memory: keep it alive as long as they live

    @property
    def tokenizer_files(self) -> dict[str, bytes]:
        return {
            name[len(TOKENIZER_PREFIX):]: bytes(array)
            for name, array in self.tensors.items()
            if name.startswith(TOKENIZER_PREFIX)
        }

    def linear(self, name: str) -> Int4Linear:
        return Int4Linear(
            self.tensors[f"{name}.qweight"], self.tensors[f"{name}.scales"], self.tensors.get(f"{name}.bias")
        )

    def layer(self, i: int) -> LayerWeights:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"a layer index must be an integer, got {type(i).__name__} {i!r:.40}")
        if not 0 <= i < self.config.num_layers:
            raise IndexError(f"layer {i} out of range for a {self.config.num_layers}-layer model")
        p = f"model.layers.{i}"
        return LayerWeights(
            input_norm=self.tensors[f"{p}.input_layernorm.weight"],
            post_norm=self.tensors[f"{p}.post_attention_layernorm.weight"],
            q=self.linear(f"{p}.self_attn.q_proj"),
            k=self.linear(f"{p}.self_attn.k_proj"),
            v=self.linear(f"{p}.self_attn.v_proj"),
            o=self.linear(f"{p}.self_attn.o_proj"),
            gate=self.linear(f"{p}.mlp.gate_proj"),
            up=self.linear(f"{p}.mlp.up_proj"),
            down=self.linear(f"{p}.mlp.down_proj"),
        )

    @property
    def embed(self) -> np.ndarray:
        return self.tensors["model.embed_tokens.weight"]

    @property
    def final_norm(self) -> np.ndarray:
        return self.tensors["model.norm.weight"]

    @property
    def lm_head(self) -> np.ndarray:
        if self.config.tie_word_embeddings:
            return self.embed
        return self.tensors["lm_head.weight"]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def verify_checksums(self) -> None:
        """Read every tensor and compare its CRC-32 with the table (slow: touches every byte)."""
        for name, expected in self._crcs.items():
            if zlib.crc32(self.tensors[name]) != expected:
                raise NanoqwenFormatError(f"{self.path}: tensor {name!r} fails its CRC-32 check (data corrupted)")

    def to_cuda(self, names=None, progress: bool = True) -> dict:
        """Copy tensors to the current CUDA device with CuPy: name -> cupy.ndarray."""
        import cupy as cp
        from tqdm import tqdm  # a text bar everywhere: tqdm.auto warns in a Jupyter kernel without ipywidgets

        names = list(self.tensors if names is None else names)
        total = sum(self.tensors[n].nbytes for n in names)
        out = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc="upload", disable=not progress) as bar:
            for name in names:
                out[name] = cp.asarray(self.tensors[name])
                bar.update(self.tensors[name].nbytes)
        return out

    @property
    def closed(self) -> bool:
        return isinstance(self.tensors, _ClosedTensors)

    def close(self) -> None:
        """Drop this model's views and unmap the file once no other view remains."""
        self.tensors = _ClosedTensors(self.path)
        try:
            self._mmap.close()
        except BufferError:
            pass  # someone still holds a tensor view; the map closes when that view dies

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Model({str(self.path)!r}, layers={c.num_layers}, hidden={c.hidden_size}, "
            f"heads={c.num_heads}:{c.num_kv_heads}, vocab={c.vocab_size}, {self.nbytes / 2**20:.1f} MiB)"
        )


def load(path: str | os.PathLike, verify_checksums: bool = False) -> Model:
    """Memory-map and validate a .nanoqwen file. Raises NanoqwenFormatError on any defect.

    The model's tensors are views of the map: do not overwrite the file in place while it is
    loaded (see the module docstring); renaming a new file over it is safe.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise NanoqwenFormatError(f"a model path must be a str or os.PathLike, got {type(path).__name__} {path!r:.80}")
    if not isinstance(verify_checksums, bool):  # "no" is truthy: no string may stand for a flag
        raise NanoqwenFormatError(f"verify_checksums must be True or False, got {verify_checksums!r:.40}")
    try:
        text = os.fspath(path)
    except TypeError as e:  # an os.PathLike whose __fspath__ returns no str
        raise NanoqwenFormatError(f"a model path must name a file as text: {e}") from None
    if not isinstance(text, str):
        raise NanoqwenFormatError(f"a model path must name a file as text, got {type(text).__name__} {text!r:.80}")
    if not text:
        raise NanoqwenFormatError("a model path is empty")
    path = Path(text)
    if "\0" in str(path):
        raise NanoqwenFormatError(f"{str(path)!r:.120}: a path cannot hold a NUL character")
    try:
        # Non-blocking, so that a FIFO is refused below instead of waiting for a writer for ever.
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            os.close(descriptor)
            raise NanoqwenFormatError(f"{path}: is not a regular file (a folder, FIFO, device or socket)")
        with open(descriptor, "rb") as f:
            size = status.st_size
            if size < HEADER_BYTES:
                raise NanoqwenFormatError(
                    f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte header"
                )
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise NanoqwenFormatError(f"{path}: cannot open: {e}") from e
    try:
        model = _validate(path, mapping, size)
    except BaseException:
        mapping.close()
        raise
    if verify_checksums:
        model.verify_checksums()
    return model


def _validate(path: Path, mapping, size: int) -> Model:
    def fail(message: str) -> NanoqwenFormatError:
        return NanoqwenFormatError(f"{path}: {message}")

    # Copies, not views: a failed validation must leave no pointer into the map it closes.
    header = np.frombuffer(mapping, dtype=HEADER_DTYPE, count=1)[0].copy()
    if header["magic"] != MAGIC:
        raise fail(f"bad magic {bytes(header['magic'])!r}, expected {MAGIC!r}: not a .nanoqwen file")
    if int(header["version"]) != VERSION:
        raise fail(f"format version {int(header['version'])} is not supported (this nanoqwen reads version {VERSION})")
    if int(header["header_bytes"]) != HEADER_BYTES or int(header["record_bytes"]) != RECORD_BYTES:
        raise fail("header or record size field is wrong")
    if int(header["file_size"]) != size:
        raise fail(f"header says the file is {int(header['file_size'])} bytes but it is {size} (truncated or extended)")
    count = int(header["tensor_count"])
    if count > MAX_TENSORS:
        raise fail(f"tensor_count {count:,} is more than the {MAX_TENSORS:,} tensors a .nanoqwen file may hold")
    table_offset = int(header["table_offset"])
    table_end = table_offset + count * RECORD_BYTES
    data_offset = int(header["data_offset"])
    if table_offset != HEADER_BYTES or not table_end <= data_offset <= size:
        raise fail(
            f"tensor table [{table_offset}, {table_end}) or data offset {data_offset} "
            f"does not fit in the {size}-byte file"
        )
    table = np.frombuffer(mapping, dtype=RECORD_DTYPE, count=count, offset=table_offset).copy()
    if header_checksum(header, table) != int(header["checksum"]):
        raise fail("header/table checksum mismatch: the header or tensor table is corrupted")

    try:
        values = {field: header[field].item() for field in CONFIG_FIELDS}
        if values["tie_word_embeddings"] not in (0, 1):
            raise ConfigError(f"tie_word_embeddings is {values['tie_word_embeddings']}, not 0 or 1")
        values["tie_word_embeddings"] = bool(values["tie_word_embeddings"])
        if values["group_size"] != GROUP_SIZE:  # the packing, the format and every kernel assume it
            raise ConfigError(f"group_size is {values['group_size']}, the format requires {GROUP_SIZE}")
        config = ModelConfig(**values)
    except (ConfigError, TypeError) as e:
        raise fail(f"invalid model configuration in header: {e}") from e

    tensors: dict[str, np.ndarray] = {}
    crcs: dict[str, int] = {}
    extents = []
    for i, record in enumerate(table):
        raw_name = bytes(record["name"]).rstrip(b"\0")
        try:
            name = raw_name.decode("ascii")
        except UnicodeDecodeError:
            raise fail(f"tensor record {i} has a non-ASCII name {raw_name!r}") from None
        if not name.isprintable():  # a name is printed (inspect): no terminal control sequences
            raise fail(f"tensor record {i} has a name with control characters {name!r}")
        if not name or name in tensors:
            raise fail(f"tensor record {i}: empty or duplicate name {name!r}")
        code, ndim = int(record["dtype"]), int(record["ndim"])
        if code not in DTYPES:
            raise fail(f"tensor {name!r}: unknown dtype code {code}")
        if not 1 <= ndim <= MAX_NDIM:
            raise fail(f"tensor {name!r}: ndim {ndim} outside 1..{MAX_NDIM}")
        shape = tuple(int(d) for d in record["shape"][:ndim])
        if min(shape) <= 0 or any(int(d) for d in record["shape"][ndim:]):
            raise fail(f"tensor {name!r}: bad shape {shape}")
        offset, nbytes = int(record["offset"]), int(record["nbytes"])
        expected_bytes = DTYPES[code].itemsize
        for d in shape:
            expected_bytes *= d
        if nbytes != expected_bytes:
            raise fail(f"tensor {name!r}: size {nbytes} does not match shape {shape} of {DTYPE_NAMES[code]}")
        if offset % ALIGNMENT:
            raise fail(f"tensor {name!r}: offset {offset} is not {ALIGNMENT}-byte aligned")
        if offset < data_offset or offset + nbytes > size:
            raise fail(f"tensor {name!r}: bytes [{offset}, {offset + nbytes}) lie outside the data region [{data_offset}, {size})")
        extents.append((offset, offset + nbytes, name))
        tensors[name] = (code, shape, offset)
        crcs[name] = int(record["crc32"])

    extents.sort()
    for (_, end, first), (start, _, second) in zip(extents, extents[1:]):
        if start < end:
            raise fail(f"tensors {first!r} and {second!r} overlap")

    if config.num_layers > count:  # each layer has tensors: don't let a bad count build a huge spec list
        raise fail(f"num_layers={config.num_layers} cannot fit in a table of {count} tensors")
    expected = config.tensor_specs()
    for name, (dtype_name, shape) in expected.items():
        if name not in tensors:
            raise fail(f"missing tensor {name!r}")
        code, actual_shape, _ = tensors[name]
        if DTYPE_NAMES[code] != dtype_name or actual_shape != shape:
            raise fail(
                f"tensor {name!r} is {DTYPE_NAMES[code]}{list(actual_shape)}, "
                f"the configuration requires {dtype_name}{list(shape)}"
            )
    for name, (code, shape, _) in tensors.items():
        # Only the known tokenizer files: unknown blobs would be CRC-checked and copied at every load.
        if name not in expected and not (name in TOKENIZER_BLOBS and DTYPE_NAMES[code] == "u8" and len(shape) == 1):
            raise fail(f"unexpected tensor {name!r}")
        if name.startswith(TOKENIZER_PREFIX) and shape[0] > MAX_JSON_BYTES:  # read whole below, parsed by Engine
            raise fail(f"tokenizer blob {name!r} holds {shape[0]:,} bytes, more than the {MAX_JSON_BYTES:,} a tokenizer file may")

    # The tokenizer blobs are small (a few MB for Qwen) and parsed at every load, so their
    # CRC-32 is checked every time: a flipped byte is a format error, not a parser's error.
    # The memoryviews are released before any error, so a rejected file leaves no export.
    for name, (code, shape, offset) in tensors.items():
        if name.startswith(TOKENIZER_PREFIX):
            with memoryview(mapping) as whole, whole[offset : offset + shape[0]] as blob:
                crc = zlib.crc32(blob)
            if crc != crcs[name]:
                raise fail(f"tensor {name!r} fails its CRC-32 check (data corrupted)")

    views = {}
    for name, (code, shape, offset) in tensors.items():
        count = 1
        for d in shape:
            count *= d
        views[name] = np.frombuffer(mapping, dtype=DTYPES[code], count=count, offset=offset).reshape(shape)
    model = Model(path, config, views, mapping)
    model._crcs = crcs
    model.tensor_table, model.file_size = table, size  # as validated: the path may name another file by now
    return model
