"""Calls into the Rust `tokenizers` library, with its failures turned into nanoqwen errors.

The library reports a file it cannot use with a plain Exception, and some it only finds while
working by panicking: pyo3 raises the panic as a BaseException, and Rust's panic hook first writes
the message and a backtrace to file descriptor 2, which would break the CLI's one-line errors.
`call_rust` catches both and keeps fd 2 clean while the library runs.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable

__all__ = ["call_rust"]

_STDERR_LOCK = threading.Lock()  # file descriptor 2 is one per process: one call borrows it at a time
_scratch: tuple[int, int] | None = None  # (pid, fd) of the file that stands in for fd 2 during a call


def _is_panic(error: BaseException) -> bool:
    """pyo3 raises a Rust panic as pyo3_runtime.PanicException, which derives from BaseException
    (so `except Exception` misses it) and which no importable module exports: it is known by name."""
    kind = type(error)
    return kind.__name__ == "PanicException" and kind.__module__ == "pyo3_runtime"


def _one_line(error: BaseException) -> str:
    """The error's message on one line (the library's may span lines; nanoqwen's errors do not).
    A MemoryError usually has no message at all: it gets one."""
    message = " ".join(str(error).split())
    if isinstance(error, MemoryError):
        return f"out of memory ({message or 'an allocation failed'})"
    return message


def _scratch_fd() -> int:
    """This process's scratch file, created at its first call into the library."""
    global _scratch
    if _scratch is None or _scratch[0] != os.getpid():  # a forked child must not share the parent's offset
        fd, name = tempfile.mkstemp(prefix="nanoqwen-stderr-")
        os.unlink(name)
        _scratch = (os.getpid(), fd)
    return _scratch[1]


def _take_scratch(fd: int) -> bytes:
    """What was written to the scratch file since the last call, leaving it empty and its offset
    (which fd 2 shares while borrowed) at 0."""
    size = os.lseek(fd, 0, os.SEEK_END)
    if not size:  # the usual case: nothing to pass on, nothing to truncate
        return b""
    data = os.pread(fd, size, 0)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    return data


def call_rust(failure: Callable[[str], Exception], function, *args):
    """`function(*args)`, a call into the tokenizers library; its failures become `failure(message)`.

    The library reports a file it cannot use with a plain Exception, and some it only finds
    while working by panicking. Rust's panic hook writes the message and a backtrace to file
    descriptor 2 before pyo3 raises, which would break the CLI's one-line errors, so during the
    call fd 2 points at a scratch file. What lands there goes on to stderr afterwards unless the
    call panicked: then the message is in the error instead.
    """
    with _STDERR_LOCK:
        scratch = _scratch_fd()
        try:
            saved = os.dup(2)
        except OSError:  # no fd 2 at all (a daemon closed it): no stderr to keep clean
            saved = None
        else:
            os.dup2(scratch, 2)
        panicked = False
        try:
            return function(*args)
        except Exception as e:
            raise failure(_one_line(e)) from None
        except BaseException as e:
            if not _is_panic(e):
                raise  # KeyboardInterrupt, SystemExit
            panicked = True
            raise failure(f"the tokenizers library panicked: {_one_line(e)}") from None
        finally:
            if saved is not None:
                os.dup2(saved, 2)
                os.close(saved)
                written = _take_scratch(scratch)
                if written and not panicked:
                    os.write(2, written)
