"""Chat templates: Jinja source that travels in a model file, compiled in a sandbox and run under limits.

A chat template is a program written by whoever made the checkpoint. jinja2's immutable sandbox
keeps it from reaching Python (no attribute of a module, no mutation of what it is handed),
but not from running forever or writing without end: `{% for i in range(100000) %}` nested
twice is ten billion iterations. So every compile and render here runs under a deadline
(MAX_TEMPLATE_SECONDS) and stops as soon as its output passes MAX_TEMPLATE_CHARS; `*` and `**`,
the two operators that build a huge value in one step, are checked before they run.
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import GenerationError

__all__ = ["MAX_CHAT_TEMPLATE_CHARS", "MAX_TEMPLATE_CHARS", "MAX_TEMPLATE_SECONDS", "compile_template", "render"]

# Qwen2.5's template is 2.5 KB, the longest published (tool calling, several languages) about
# 20 KB; compiling grows with the source, so a limit on the source bounds it too.
MAX_CHAT_TEMPLATE_CHARS = 256 * 1024
# Qwen2.5's renders a conversation in about a millisecond; one that needs a second is looping.
MAX_TEMPLATE_SECONDS = 1.0
# A prompt longer than this could not fit any context: 32K tokens of code are ~130K characters.
MAX_TEMPLATE_CHARS = 16 * 2**20
# `a ** b` of integers costs time and memory in proportion to the bits of its result.
MAX_POWER_BITS = 2**20


class _Expired(BaseException):
    """Raised inside a compile or render that ran past MAX_TEMPLATE_SECONDS. A BaseException, so
    that no `except Exception` inside jinja2 can swallow it."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _Expired in this thread if the block is still running after `seconds`.

    A template compiles to Python code whose loops never come back to us to be checked, so a
    timer thread schedules the exception with CPython's PyThreadState_SetAsyncExc, which the
    looping thread raises at its next bytecode. The lock orders the timer against the end of the
    block, and clearing any pending exception there keeps a late timer from striking after it.
    """
    thread_id = ctypes.c_ulong(threading.get_ident())
    lock = threading.Lock()
    running = [True]

    def expire() -> None:
        with lock:
            if running[0]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(thread_id, ctypes.py_object(_Expired))

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            running[0] = False
            ctypes.pythonapi.PyThreadState_SetAsyncExc(thread_id, None)
        timer.cancel()


def _repeat_length(left, right) -> int:
    """Length of `left * right` when it repeats a string or a list, else 0."""
    for sequence, count in ((left, right), (right, left)):
        if isinstance(sequence, (str, list, tuple)) and isinstance(count, int):
            return len(sequence) * count
    return 0


class _Environment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with `*` and `**` checked before they build their result."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*" and _repeat_length(left, right) > MAX_TEMPLATE_CHARS:
            raise SecurityError(f"a repetition of {_repeat_length(left, right):,} items exceeds {MAX_TEMPLATE_CHARS:,}")
        if (operator == "**" and isinstance(left, int) and isinstance(right, int)
                and left.bit_length() * abs(right) > MAX_POWER_BITS):
            raise SecurityError(f"a {left.bit_length()}-bit integer ** {right} would exceed {MAX_POWER_BITS:,} bits")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message):
    raise GenerationError(f"chat template: {message}")


def _tojson(value, indent=None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _limited(what: str, run):
    """`run()` under MAX_TEMPLATE_SECONDS; GenerationError naming `what` when it runs out."""
    try:
        with _deadline(MAX_TEMPLATE_SECONDS):
            return run()
    except _Expired:
        raise GenerationError(f"the tokenizer's chat template took longer than {MAX_TEMPLATE_SECONDS:g} s to {what}") from None


def compile_template(source: str) -> jinja2.Template:
    """A sandboxed template with the options and helpers transformers gives chat templates."""
    if len(source) > MAX_CHAT_TEMPLATE_CHARS:
        raise GenerationError(f"the chat template has {len(source):,} characters, more than {MAX_CHAT_TEMPLATE_CHARS:,}")
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return _limited("compile", lambda: env.from_string(source))


def render(template: jinja2.Template, **context) -> str:
    """The template's output for `context`, within MAX_TEMPLATE_SECONDS and MAX_TEMPLATE_CHARS."""

    def collect() -> str:
        pieces, length = [], 0
        for piece in template.generate(**context):
            length += len(piece)
            if length > MAX_TEMPLATE_CHARS:
                raise GenerationError(f"the tokenizer's chat template wrote more than {MAX_TEMPLATE_CHARS:,} characters")
            pieces.append(piece)
        return "".join(pieces)

    return _limited("render", collect)
