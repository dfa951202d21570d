"""JSON from files nanoqwen does not trust: a checkpoint's config.json, its safetensors headers and
index, and the tokenizer_config.json that a .nanoqwen file carries.

`json.loads` alone is not enough for such input. Its C scanner recurses once per nesting level,
so `[[[[...]]]]` a hundred thousand levels deep raises RecursionError, and a value nested a
thousand levels deep that it did accept can still break whatever recurses over it later (a
template's `tojson`, `json.dumps`). Every file nanoqwen reads is at most a few levels deep, so
`parse_json` refuses anything deeper than MAX_JSON_DEPTH and anything larger than
MAX_JSON_BYTES, each with a JSONLimitError that says which limit was crossed. Callers wrap that
message into their own error naming the file.

tokenizer.json itself goes to the Rust `tokenizers` library, whose JSON parser stops at its own
recursion limit (128 levels) with an ordinary error; only its size is limited here.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

__all__ = ["JSONLimitError", "MAX_JSON_BYTES", "MAX_JSON_DEPTH", "RepeatedKeyError", "check_json_size",
           "json_nesting_depth", "parse_json", "read_json_file"]

# Hugging Face files nest at most 6 levels (tokenizer.json's normalizer sequences); 32 leaves
# room and keeps any later recursion over the value far below Python's limit of ~1000 frames.
MAX_JSON_DEPTH = 32
# The largest JSON a checkpoint holds is tokenizer.json: 7 MB for Qwen2.5, about 35 MB for the
# largest vocabularies published. Anything bigger is not a tokenizer, and this bounds the time
# the tokenizers library takes to build one (about 4 s at the limit on two slow cores).
MAX_JSON_BYTES = 64 * 2**20

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # brackets inside strings do not nest
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]")


class RepeatedKeyError(ValueError):
    """An object of JSON read with `unique_keys` that names one key twice; the message is a phrase
    that follows the file's name."""


class JSONLimitError(ValueError):
    """JSON beyond MAX_JSON_BYTES or MAX_JSON_DEPTH; the message says which, as a phrase that
    follows the file's name ("config.json: nested 40 levels deep, ...")."""


def check_json_size(nbytes: int) -> None:
    """JSONLimitError when `nbytes` of JSON exceed MAX_JSON_BYTES."""
    if nbytes > MAX_JSON_BYTES:
        raise JSONLimitError(f"holds {nbytes:,} bytes, more than the {MAX_JSON_BYTES:,} bytes of JSON nanoqwen reads")


def read_json_file(path: Path) -> bytes:
    """The bytes of `path`, refused with JSONLimitError before reading when it is too large, or
    no regular file (reading a FIFO would wait for a writer for ever)."""
    if not path.is_file():
        raise JSONLimitError("is not a regular file (a folder, FIFO, device or socket)")
    check_json_size(path.stat().st_size)
    return path.read_bytes()


def json_nesting_depth(text: str) -> int:
    """How deeply the arrays and objects of the valid JSON `text` nest (0 for a bare scalar)."""
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text)).encode("ascii")
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max()) if steps.size else 0


def _object_without_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        counts = Counter(key for key, _ in pairs)
        repeated = next(key for key, count in counts.items() if count > 1)
        raise RepeatedKeyError(f"names {repeated!r:.80} more than once in one object")
    return obj


def parse_json(data: bytes, unique_keys: bool = False):
    """The value of the UTF-8 JSON `data`, within MAX_JSON_BYTES and MAX_JSON_DEPTH. With
    `unique_keys`, an object that repeats a key is refused (json.loads keeps the last of them,
    a reader in another language may keep the first).

    Raises ValueError naming the problem: UnicodeDecodeError, json.JSONDecodeError, RepeatedKeyError
    or JSONLimitError.
    """
    check_json_size(len(data))
    text = data.decode("utf-8")
    try:
        value = json.loads(text, object_pairs_hook=_object_without_repeated_keys if unique_keys else None)
    except RecursionError:
        raise JSONLimitError(f"nested more than the {MAX_JSON_DEPTH} levels of JSON nanoqwen reads") from None
    except (json.JSONDecodeError, RepeatedKeyError):
        raise
    except ValueError:  # Python's own cap on the digits of an integer it converts from text
        raise JSONLimitError(f"holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                             "more than nanoqwen reads") from None
    depth = json_nesting_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise JSONLimitError(f"nested {depth} levels deep, more than the {MAX_JSON_DEPTH} levels of JSON nanoqwen reads")
    return value
