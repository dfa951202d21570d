"""Chat templates: Jinja source that travels in a model file, compiled in a sandbox and run under limits.

A chat template is a program written by whoever made the checkpoint. jinja2's immutable sandbox
keeps it from reaching Python (no attribute of a module, no mutation of what it is handed),
but not from running forever or writing without end: `{% for i in range(100000) %}` nested
twice is ten billion iterations. So every compile and render here runs under a deadline
(MAX_TEMPLATE_SECONDS) and stops as soon as its output passes MAX_TEMPLATE_CHARS.

The deadline cannot stop a single call into C, and one call can build a huge value from a few
characters of source: `'a'|center(4000000000)` (which jinja2 even runs while compiling, to fold
constants), `'%1500000000d' % 1`, `s.replace('x', s)`, or `s + s` doubled thirty times. So every
operation whose output size its arguments set is checked before it runs and refused when it would
write more than MAX_TEMPLATE_CHARS: `+` and `~`, `*` and `**`, `%` on strings, str.format and format_map, the str methods
that pad, expand or join, and the filters that do the same (center, indent, format, wordwrap,
join, replace, batch's fill, tojson's indent), and printing a container of strings.
"""

from __future__ import annotations

import ctypes
import json
import re
import threading
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import wraps

import jinja2.ext
from jinja2 import filters, pass_eval_context
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter

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


def _printed_length(value, limit: int) -> int:
    """Roughly len(str(value)) for a container: its strings' characters and a few for anything
    else, walked only until the sum passes `limit` (str() itself is one call the deadline cannot stop)."""
    pending, length = [value], 0
    while pending and length <= limit:
        item = pending.pop()
        if isinstance(item, str):
            length += len(item) + 4  # quotes and a separator
        elif isinstance(item, (list, tuple, set, frozenset)):
            pending.extend(item)
            length += 2
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
            length += 2
        else:
            length += 8  # a number, None, a boolean
    return length


def _repeat_length(left, right) -> int:
    """Characters that printing `left * right` would write when it repeats a string (exactly) or a
    list (as _printed_length counts them, walked no further than the limit needs), else 0."""
    for sequence, count in ((left, right), (right, left)):
        if not isinstance(count, int) or count <= 0:
            continue
        if isinstance(sequence, str):
            return len(sequence) * count
        if isinstance(sequence, (list, tuple)) and sequence:
            brackets = 2  # printed once, however often the items repeat
            items = _printed_length(sequence, MAX_TEMPLATE_CHARS // count + brackets) - brackets
            return items * count + brackets
    return 0


def _added_length(left, right) -> int:
    """Characters of `left + right` when it adds two strings, or what printing it would write when
    it adds two lists, else 0."""
    if isinstance(left, str) and isinstance(right, str):
        return len(left) + len(right)
    if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        return _printed_length(left, MAX_TEMPLATE_CHARS) + _printed_length(right, MAX_TEMPLATE_CHARS)
    return 0


def _finalize(value):
    """Every `{{ value }}` before jinja2 turns it to text: a list of a thousand long strings, built
    cheaply from references, would print gigabytes in one call."""
    if not isinstance(value, str):
        _check_length(_printed_length(value, MAX_TEMPLATE_CHARS), "printing a value")
    return value


# ---- sizes of what an operation would write, computed before it runs ----

# Every character str.splitlines (and so the indent filter) starts a new line at.
LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
# A %-format field: mapping key, flags, width, precision, length modifier, conversion.
PERCENT_FIELD = re.compile(r"%(?:\(([^)]*)\))?[#0 +-]*(\*|[0-9]*)(?:\.(\*|[0-9]*))?[hlL]?(.?)", re.DOTALL)


def _check_length(length: int, what: str) -> None:
    if length > MAX_TEMPLATE_CHARS:
        raise SecurityError(f"{what} would write {length:,} characters, more than {MAX_TEMPLATE_CHARS:,}")


def _text_length(value) -> int:
    return len(value) if isinstance(value, str) else len(str(value))


def _number(digits: str) -> int:
    """A width or precision written in a format; past 12 digits, any number over every limit
    (int() refuses more than 4,300 digits, and a spec may hold more)."""
    return int(digits[:12] or 0)


def _spec_length(spec: str) -> int:
    """Characters a format spec can pad its value to: every number in it counted (widths and
    precisions; others, like a fill of '0', are small)."""
    return sum(_number(digits) for digits in re.findall("[0-9]+", spec))


def _percent_length(template: str, values) -> int:
    """A bound on the length of `template % values`; 0 when the values do not fit the fields,
    which the operation itself then reports."""
    positional = iter(values if isinstance(values, tuple) else (values,))
    length = len(template)
    try:
        for key, width, precision, conversion in PERCENT_FIELD.findall(template):
            if conversion == "%":
                continue
            for number in (width, precision):
                length += abs(next(positional)) if number == "*" else _number(number)  # a negative * width pads left
            value = values[key] if key else next(positional)
            length += len(repr(value)) if conversion in "ra" else _text_length(value)
    except (StopIteration, LookupError, TypeError):
        return 0
    return length


def _replaced_length(s, old, new, count=-1) -> int:
    s, old, new = str(s), str(old), str(new)
    matches = s.count(old) if old else len(s) + 1  # an empty `old` matches between every two characters
    if isinstance(count, int) and count >= 0:
        matches = min(matches, count)
    return len(s) + matches * max(len(new) - len(old), 0)


def _joined_length(separator, items: list) -> int:
    return sum(map(_text_length, items)) + len(str(separator)) * max(len(items) - 1, 0)


def _indented_length(s, width=4, first=False, blank=False) -> int:
    s = str(s)
    indention = len(width) if isinstance(width, str) else width
    lines = sum(map(s.count, LINE_BREAKS)) + 2
    return len(s) + lines * indention


def _wrapped_length(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True) -> int:
    s = str(s)
    return len(s) + (len(s) + 1) * len(wrapstring or "\n")  # at worst a line per character


def _str_method_length(method, args: tuple, kwargs: dict) -> int:
    """A bound on what a method of a str (or of a Markup, whose methods wrap str's) that pads or
    expands would write; 0 for the others."""
    s, name = method.__self__, method.__name__
    arguments = [*args, *kwargs.values()]
    if name in ("center", "ljust", "rjust", "zfill") and arguments and isinstance(arguments[0], int):
        return max(len(s), arguments[0])
    if name == "expandtabs":
        tabsize = arguments[0] if arguments else 8
        return len(s) + s.count("\t") * tabsize if isinstance(tabsize, int) else 0
    if name == "replace" and len(arguments) >= 2:
        return _replaced_length(s, *arguments[:3])
    if name == "translate" and arguments and isinstance(arguments[0], Mapping):
        longest = max((_text_length(v) for v in arguments[0].values() if v is not None), default=1)
        return len(s) * max(longest, 1)
    return 0


class _BoundedFormatter(SandboxedFormatter):
    """str.format's sandboxed formatter, refusing a field before it runs when it would take the
    format past MAX_TEMPLATE_CHARS. Nested fields (`'{:{}}'.format(1, width)`) are formatted
    first, so the width a spec receives from one is checked too."""

    def __init__(self, env, what: str):
        super().__init__(env)
        self.what = what
        self.length = 0

    def format_field(self, value, format_spec: str) -> str:
        self.length += _spec_length(format_spec) + _text_length(value)
        _check_length(self.length, self.what)
        return super().format_field(value, format_spec)


# ---- the environment ----


class _CodeGenerator(CodeGenerator):
    """jinja2's code generator, with every `a ~ b` handed to _Environment.sized_concat, which
    measures the parts before it joins them (jinja2 joins them inline, where no hook sees them)."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.sized_concat(context, (")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


class _Environment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with the operations that build a huge value in one step
    checked before they run."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def sized_concat(self, context, parts: tuple) -> str:
        _check_length(sum(len(p) if isinstance(p, str) else _printed_length(p, MAX_TEMPLATE_CHARS) for p in parts),
                      "a ~ concatenation")
        return (markup_join if context.eval_ctx.autoescape else str_join)(parts)

    def call_binop(self, context, operator, left, right):
        if operator == "+":
            _check_length(_added_length(left, right), "a +")
        if operator == "*":
            _check_length(_repeat_length(left, right), "a repetition")
        if (operator == "**" and isinstance(left, int) and isinstance(right, int)
                and left.bit_length() * abs(right) > MAX_POWER_BITS):
            raise SecurityError(f"a {left.bit_length()}-bit integer ** {right} would exceed {MAX_POWER_BITS:,} bits")
        if operator == "%" and isinstance(left, str):
            _check_length(_percent_length(left, right), "a %-format")
        return super().call_binop(context, operator, left, right)

    # jinja2's own parameter names: double underscores, which no keyword argument can clash with
    def call(__self, __context, __obj, *args, **kwargs):
        if isinstance(__obj, (types.BuiltinMethodType, types.MethodType)) and isinstance(__obj.__self__, str):
            if __obj.__name__ == "join" and len(args) == 1 and not kwargs:
                args = (list(args[0]),)  # measured, then joined: an iterator would be spent
                _check_length(_joined_length(__obj.__self__, args[0]), "str.join")
            _check_length(_str_method_length(__obj, args, kwargs), f"str.{__obj.__name__}")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """str.format and format_map, run first by a formatter that checks each field before it
        formats it (the text between fields is the template's own)."""
        format_call = super().wrap_str_format(value)
        if format_call is None:
            return None
        template, is_format_map = value.__self__, value.__name__ == "format_map"

        @wraps(format_call)
        def bounded(*args, **kwargs):
            what = f"str.{value.__name__}"
            if not is_format_map:
                _BoundedFormatter(self, what).vformat(template, args, kwargs)
            elif len(args) == 1 and not kwargs:
                _BoundedFormatter(self, what).vformat(template, (), args[0])
            return format_call(*args, **kwargs)

        return bounded


def _bounded_filter(original, length, what: str):
    """`original`, a jinja2 filter, refused when `length(*its arguments)` exceeds MAX_TEMPLATE_CHARS."""

    @wraps(original)  # keeps the pass_eval_context / pass_environment mark, so jinja2 passes the same first argument
    def bounded(*args, **kwargs):
        passed = args[1:] if getattr(original, "jinja_pass_arg", None) else args
        _check_length(length(*passed, **kwargs), f"the {what} filter")
        return original(*args, **kwargs)

    return bounded


@pass_eval_context
def _join(eval_ctx, value, d: str = "", attribute=None) -> str:
    """jinja2's join, measured first (with an attribute the items' text is not known: only the separators count)."""
    items = list(value)
    _check_length(_joined_length(d, items if attribute is None else [""] * len(items)), "the join filter")
    return filters.do_join(eval_ctx, items, d, attribute)


def _batch(value, linecount: int, fill_with=None):
    if fill_with is not None:
        _check_length(linecount, "the batch filter's fill")
    return filters.do_batch(value, linecount, fill_with)


BOUNDED_FILTERS = {
    "center": _bounded_filter(filters.do_center, lambda value, width=80: max(_text_length(value), width), "center"),
    "indent": _bounded_filter(filters.do_indent, _indented_length, "indent"),
    "format": _bounded_filter(filters.do_format, lambda value, *args, **kwargs: _percent_length(str(value), kwargs or args), "format"),
    "wordwrap": _bounded_filter(filters.do_wordwrap, _wrapped_length, "wordwrap"),
    "replace": _bounded_filter(filters.do_replace, _replaced_length, "replace"),
    "join": _join,
    "batch": _batch,
}


def _raise_exception(message):
    raise GenerationError(f"chat template: {message}")


def _json_line_units(value, level: int = 0) -> int:
    """What json.dumps(value, indent=...) adds to the compact text, in units of one newline or one
    indentation: each item of a non-empty list or dict starts a line at the next level, and its
    closing bracket one at this level."""
    if not isinstance(value, (list, tuple, dict)) or not value:
        return 0
    items = value.values() if isinstance(value, dict) else value
    return sum(2 + level + _json_line_units(item, level + 1) for item in items) + 1 + level


def _tojson(value, indent=None) -> str:
    text = json.dumps(value, ensure_ascii=False)
    if indent is None:
        return text
    width = len(indent) if isinstance(indent, str) else indent
    _check_length(len(text) + _json_line_units(value) * max(width, 1), "the tojson filter")
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
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                       finalize=_finalize)
    env.filters.update(BOUNDED_FILTERS, tojson=_tojson)
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
