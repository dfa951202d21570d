"""The .nanoqwen file, version 1: byte layout and a streaming writer.

    offset 0     header, 256 bytes (HEADER_DTYPE)
    offset 256   tensor table, one 128-byte record per tensor (RECORD_DTYPE)
    data_offset  tensors, each starting on a 128-byte boundary, in table order

All integers are little-endian. The header's `checksum` is the CRC-32 of the header (with
the checksum field zeroed) followed by the table, so a flipped bit in either is caught before
any offset is trusted. Each record carries the CRC-32 of its tensor's bytes, checked on demand.
`book/format-spec.md` is the human-readable version of this module.
"""

from __future__ import annotations

import os
import secrets
import signal
import stat
import threading
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from .config import ModelConfig

MAGIC = b"NANOQWEN"
VERSION = 1
ALIGNMENT = 128  # one L2 cache line on Hopper: every tensor starts on a line of its own
HEADER_BYTES = 256
RECORD_BYTES = 128
MAX_NAME_BYTES = 64
MAX_NDIM = 4
# The 7B's file holds 538 tensors, a model of 80 layers 1,526: the cap bounds the table a reader
# copies (8 MiB) before anything else in the file is trusted, whatever size a sparse file declares.
MAX_TENSORS = 65_536
# A new file is created, never an existing one reused, and never through a symbolic link: two
# writers of one path, or a link planted where the temporary file goes, cannot mix bytes.
PARTIAL_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

# dtype code -> numpy dtype. Packed INT4 weights are stored as their uint32 words.
DTYPES = {1: np.dtype("<f2"), 2: np.dtype("<f4"), 3: np.dtype("<u4"), 4: np.dtype("u1")}
DTYPE_NAMES = {1: "f16", 2: "f32", 3: "u32", 4: "u8"}
DTYPE_CODES = {name: code for code, name in DTYPE_NAMES.items()}

HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("header_bytes", "<u4"),
        ("num_layers", "<u4"),
        ("hidden_size", "<u4"),
        ("intermediate_size", "<u4"),
        ("num_heads", "<u4"),
        ("num_kv_heads", "<u4"),
        ("head_dim", "<u4"),
        ("vocab_size", "<u4"),
        ("max_position_embeddings", "<u4"),
        ("group_size", "<u4"),
        ("tie_word_embeddings", "<u4"),
        ("rope_theta", "<f8"),
        ("rms_norm_eps", "<f8"),
        ("tensor_count", "<u4"),
        ("record_bytes", "<u4"),
        ("table_offset", "<u8"),
        ("data_offset", "<u8"),
        ("file_size", "<u8"),
        ("checksum", "<u4"),
        ("reserved", "V148"),
    ]
)
assert HEADER_DTYPE.itemsize == HEADER_BYTES

RECORD_DTYPE = np.dtype(
    [
        ("name", f"S{MAX_NAME_BYTES}"),
        ("dtype", "<u4"),
        ("ndim", "<u4"),
        ("shape", "<u8", (MAX_NDIM,)),
        ("offset", "<u8"),
        ("nbytes", "<u8"),
        ("crc32", "<u4"),
        ("reserved", "V4"),
    ]
)
assert RECORD_DTYPE.itemsize == RECORD_BYTES

CONFIG_FIELDS = (
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "group_size",
    "tie_word_embeddings",
    "rope_theta",
    "rms_norm_eps",
)


def align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def header_checksum(header: np.ndarray, table: np.ndarray) -> int:
    """CRC-32 of the header with its checksum zeroed, then the table."""
    blank = header.copy()
    blank["checksum"] = 0
    return zlib.crc32(table.tobytes(), zlib.crc32(blank.tobytes()))


def plan_layout(entries: list[tuple[str, str, tuple[int, ...]]]) -> tuple[np.ndarray, int, int]:
    """Place tensors: (name, dtype name, shape) -> (table records, data_offset, file_size)."""
    if len(entries) > MAX_TENSORS:
        raise ValueError(f"{len(entries)} tensors are more than the {MAX_TENSORS} a .nanoqwen file may hold")
    table = np.zeros(len(entries), dtype=RECORD_DTYPE)
    data_offset = align_up(HEADER_BYTES + RECORD_BYTES * len(entries))
    offset = data_offset
    seen = set()
    for record, (name, dtype_name, shape) in zip(table, entries):
        encoded = name.encode("ascii")
        if not encoded or len(encoded) > MAX_NAME_BYTES or name in seen or not name.isprintable():
            raise ValueError(f"tensor name {name!r} is empty, duplicated, longer than {MAX_NAME_BYTES} bytes "
                             "or holds control characters")
        if not 1 <= len(shape) <= MAX_NDIM or min(shape) <= 0:
            raise ValueError(f"tensor {name!r} has unsupported shape {shape}")
        seen.add(name)
        code = DTYPE_CODES[dtype_name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[code].itemsize
        record["name"] = encoded
        record["dtype"] = code
        record["ndim"] = len(shape)
        record["shape"][: len(shape)] = shape
        record["offset"] = offset
        record["nbytes"] = nbytes
        offset = align_up(offset + nbytes)
    return table, data_offset, offset


def _exit_on_signal(signum, frame):
    """Raise SystemExit with the status a shell reports for a process ended by the signal; where the
    signal lands inside a __del__ (a library's, run by the collector), Python would print that
    exception and drop it, so the signal is sent again once the __del__ has returned."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
            return
        frame = frame.f_back
    raise SystemExit(128 + signum)


# The signals that end a process by default and that a program may catch: `kill`, and a terminal
# that goes away (a closed window, a dropped ssh session). SIGINT raises KeyboardInterrupt already.
TERMINATION_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextmanager
def termination_raises_system_exit() -> Iterator[None]:
    """In the main thread, make SIGTERM and SIGHUP raise SystemExit(128 + signal) instead of ending
    the process on the spot, so that the `finally` and `__exit__` blocks on the way out run (the
    writer's removes its temporary file; so do the tools' scratch folders). A handler someone else
    installed is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = [s for s in TERMINATION_SIGNALS if signal.getsignal(s) == signal.SIG_DFL]
    previous = {s: signal.signal(s, _exit_on_signal) for s in ours}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def output_file_problem(path: str | os.PathLike, renamed_over: bool = True) -> OSError | None:
    """Why no file can be written at `path`, or None: it must be in a folder that exists, and be
    neither a folder (nor written as one, with a trailing slash) nor, where the file is written
    beside it and renamed over it, a device, FIFO or socket (special_file_problem). Everything
    that writes a file when its work ends (the .nanoqwen writer, `nanoqwen bench --json`, the
    tools' records) asks before the work begins."""
    text = os.fspath(path)
    if not text:  # Path("") is the working directory
        return FileNotFoundError("the output path is empty")
    if text.endswith((os.sep, "/")):  # Path() drops the slash, and would write a file of that name
        return IsADirectoryError(f"{text}: names a folder")
    path = Path(text)
    if path.is_dir():
        return IsADirectoryError(f"{path}: is a folder")
    if not path.parent.is_dir():
        return FileNotFoundError(f"{path}: the folder {path.parent} does not exist")
    return special_file_problem(path) if renamed_over else None


def special_file_problem(path: Path) -> FileExistsError | None:
    """A written file replaces only a regular file, or a symbolic link to one (the rename replaces
    the link, not its target): renaming over a device or a FIFO would destroy it, /dev/null
    included, and so would renaming over a link that names one, /dev/stdout included."""
    try:
        mode = os.stat(path).st_mode  # through a link, to what it names
    except OSError:  # nothing there, or a link to nothing: the rename makes a new file
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return FileExistsError(f"{path}: exists and is not a regular file (a device, FIFO or socket)")


def check_out(out: str | os.PathLike) -> None:
    """Raise output_file_problem's error for a path a .nanoqwen file is to be written to."""
    problem = output_file_problem(out)
    if problem is not None:
        raise type(problem)(f"{problem}; OUT must be the path of the .nanoqwen file to write")


class NanoqwenWriter:
    """Write a .nanoqwen file tensor by tensor, atomically.

    The layout is fixed up front from the list of (name, dtype, shape), so each tensor can be
    written as soon as it is produced and then dropped: memory stays at one tensor. Bytes go to
    a new file `<path>.<random>.partial` beside `path`, created exclusively (PARTIAL_OPEN_FLAGS);
    only `close()` after every tensor was written renames it to `path`, so an interrupted
    conversion never leaves a file that looks complete, and a reader of `path` sees the old file
    or the new one, whole. An exception, Ctrl-C, SIGTERM or SIGHUP while the writer is used as a
    context manager removes the temporary file; only SIGKILL or a power cut can leave one behind.
    """

    def __init__(self, path: str | os.PathLike, config: ModelConfig, entries):
        check_out(path)  # and again for a special file at the rename, in close()
        self.path = Path(path)
        self.partial = self.path.with_name(f"{self.path.name}.{secrets.token_hex(6)}.partial")
        self._while_open = ExitStack()  # what __enter__ sets up and __exit__ undoes
        self.table, self.data_offset, self.file_size = plan_layout(list(entries))
        self.index = {rec["name"].decode(): i for i, rec in enumerate(self.table)}
        self.written: set[str] = set()
        self.header = np.zeros((), dtype=HEADER_DTYPE)
        self.header["magic"] = MAGIC
        self.header["version"] = VERSION
        self.header["header_bytes"] = HEADER_BYTES
        for field in CONFIG_FIELDS:
            self.header[field] = getattr(config, field)
        self.header["tensor_count"] = len(self.table)
        self.header["record_bytes"] = RECORD_BYTES
        self.header["table_offset"] = HEADER_BYTES
        self.header["data_offset"] = self.data_offset
        self.header["file_size"] = self.file_size
        try:
            descriptor = os.open(self.partial, PARTIAL_OPEN_FLAGS, 0o666)
        except OSError as e:  # name the folder the user chose, not the temporary file's random name
            raise type(e)(e.errno, f"cannot create {self.path.name} in {self.path.parent} ({e.strerror})") from None
        self.file = os.fdopen(descriptor, "wb")
        try:
            with self._naming_the_output():
                self.file.truncate(self.file_size)
        except BaseException:
            self.abort()
            raise

    @contextmanager
    def _naming_the_output(self) -> Iterator[None]:
        """An OSError while writing (a full disk, a file-size limit) names the file the user chose,
        not the temporary file's random name."""
        try:
            yield
        except OSError as e:
            raise type(e)(e.errno, f"cannot write {self.path} ({e.strerror})") from None

    def write(self, name: str, array: np.ndarray) -> None:
        if name not in self.index:
            raise KeyError(f"tensor {name!r} is not in this file's layout")
        if name in self.written:
            raise ValueError(f"tensor {name!r} was already written")
        record = self.table[self.index[name]]
        dtype = DTYPES[int(record["dtype"])]
        shape = tuple(int(d) for d in record["shape"][: int(record["ndim"])])
        if array.shape != shape:
            raise ValueError(f"tensor {name!r}: expected shape {shape}, got {array.shape}")
        # A byte view, not .tobytes(): a copy would double the memory of the largest tensor.
        data = memoryview(np.ascontiguousarray(array, dtype=dtype)).cast("B")
        record["crc32"] = zlib.crc32(data)
        with self._naming_the_output():
            self.file.seek(int(record["offset"]))
            self.file.write(data)
        self.written.add(name)

    def close(self) -> Path:
        missing = set(self.index) - self.written
        if missing:
            self.abort()
            raise ValueError(f"{len(missing)} tensors were never written, e.g. {sorted(missing)[0]!r}")
        self.header["checksum"] = header_checksum(self.header, self.table)
        with self._naming_the_output():
            self.file.seek(0)
            self.file.write(self.header.tobytes())
            self.file.write(self.table.tobytes())
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        problem = special_file_problem(self.path)  # a device or FIFO made there after check_out ran
        if problem is not None:
            self.abort()
            raise problem
        os.replace(self.partial, self.path)
        return self.path

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.partial.unlink(missing_ok=True)

    def __enter__(self) -> "NanoqwenWriter":
        self._while_open.enter_context(termination_raises_system_exit())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None:
                self.abort()
        finally:
            self._while_open.close()
