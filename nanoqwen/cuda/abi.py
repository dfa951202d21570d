"""The numbers the host and the kernels must agree on, read from the kernel sources.

The decode state's layout, the status words, block sizes and the most warps a GEMV block holds are
each defined once, in kernels/ (`#define NAME value` or `constexpr int NAME = value;`, a value being
a number or an earlier NAME of the same file or of a file it includes). This module reads them from there,
so they are known without a GPU (the planning helpers and CPU tests use them), and every compiled
module exports them again as `__device__ int abi_NAME` (common.cuh's NQ_EXPORT_INT), which
`check_compiled` compares at engine start: the host never restates a kernel's number.
"""

from __future__ import annotations

import re
from functools import cache

from ..quant import TILE_ROWS as HOST_TILE_ROWS
from .build import kernel_dir, module_int

_DEFINITION = re.compile(r"^\s*(?:#define\s+(\w+)\s+(\w+)|constexpr\s+int\s+(\w+)\s*=\s*(\w+)\s*;)", re.M)
_INCLUDE = re.compile(r'^#include "([\w.]+)"', re.M)


@cache
def _definitions(file: str) -> dict[str, str]:
    """NAME -> the token it is defined as, in `file` and the kernel files it includes."""
    text = (kernel_dir() / file).read_text()
    found = {}
    for included in _INCLUDE.findall(text):
        found.update(_definitions(included))
    for match in _DEFINITION.finditer(text):
        name, value = (match.group(1), match.group(2)) if match.group(1) else (match.group(3), match.group(4))
        found[name] = value
    return found


def kernel_int(file: str, name: str) -> int:
    """The integer `name` is defined as in kernels/`file`, following names to a number."""
    definitions, token, seen = _definitions(file), name, set()
    while not token.isdigit():
        if token in seen or token not in definitions:
            raise LookupError(f"kernels/{file} defines no integer {name!r}")
        seen.add(token)
        token = definitions[token]
    return int(token)


# name -> the kernel file that defines it
SOURCES = {
    "STATE_TOKEN": "common.cuh", "STATE_POSITION": "common.cuh", "STATE_SEQ_LEN": "common.cuh",
    "STATE_STATUS": "common.cuh", "STATE_PAGE_TABLE": "common.cuh",
    "STATUS_NOT_FINITE": "common.cuh", "STATUS_HOST_DRAWS": "common.cuh",
    "ELEMENTWISE_THREADS": "common.cuh",
    "TILE_ROWS": "gemv_int4.cu", "SPLIT_K_MAX_WARPS": "gemv_int4.cu", "CHAIN_GEMV_MIN_BLOCKS": "gemv_int4.cu",
    "GATE_UP_MAX_SPLITS": "gemv_int4.cu", "GATE_UP_MIN_BLOCKS": "gemv_int4.cu",
    "RMS_CLUSTER": "rmsnorm.cu", "LM_THREADS": "lm_head.cu",
    "ARGMAX_THREADS": "sampler.cu", "TOP_K_MAX": "sampler.cu",
    "VERIFY_ROWS": "verify.cu", "NARROW_ROWS": "verify.cu",
    "PERSIST_THREADS": "decode_persistent.cu", "OPS_PER_LAYER": "decode_persistent.cu",
    "LAYER_POINTERS": "decode_persistent.cu",
}


def _source(name: str) -> int:
    return kernel_int(SOURCES[name], name)


STATE_TOKEN = _source("STATE_TOKEN")  # offsets into the decode state (int32)
STATE_POSITION = _source("STATE_POSITION")
STATE_SEQ_LEN = _source("STATE_SEQ_LEN")
STATE_STATUS = _source("STATE_STATUS")
STATE_PAGE_TABLE = _source("STATE_PAGE_TABLE")  # the head before it: token .. status
STATUS_NOT_FINITE = _source("STATUS_NOT_FINITE")  # values of state[STATE_STATUS] besides 0
STATUS_HOST_DRAWS = _source("STATUS_HOST_DRAWS")
ELEMENTWISE_THREADS = _source("ELEMENTWISE_THREADS")
TILE_ROWS = _source("TILE_ROWS")
GEMV_MAX_SPLITS = _source("SPLIT_K_MAX_WARPS")  # warps of a split-K GEMV block
CHAIN_GEMV_MIN_BLOCKS = _source("CHAIN_GEMV_MIN_BLOCKS")  # blocks of GEMV_MAX_SPLITS warps of q|k|v and o an SM holds (their register bound)
GATE_UP_MAX_SPLITS = _source("GATE_UP_MAX_SPLITS")  # warps of a gate+up block
GATE_UP_MIN_BLOCKS = _source("GATE_UP_MIN_BLOCKS")  # blocks of GATE_UP_MAX_SPLITS warps of gate+up an SM holds (its register bound)
RMS_CLUSTER = _source("RMS_CLUSTER")  # blocks of add_rmsnorm_cluster's clusters
LM_HEAD_THREADS = _source("LM_THREADS")
ARGMAX_THREADS = _source("ARGMAX_THREADS")
TOP_K_MAX = _source("TOP_K_MAX")  # the largest top-k the device sampler applies
VERIFY_ROWS = _source("VERIFY_ROWS")  # the most rows of a verify pass
NARROW_ROWS = _source("NARROW_ROWS")  # the most rows of the narrow verify GEMVs
PERSIST_THREADS = _source("PERSIST_THREADS")  # a block of the persistent decode kernel
OPS_PER_LAYER = _source("OPS_PER_LAYER")  # its counters per layer
LAYER_POINTERS = _source("LAYER_POINTERS")  # columns of its layer table

if TILE_ROWS != HOST_TILE_ROWS:
    raise ImportError(f"kernels/gemv_int4.cu tiles {TILE_ROWS} rows, nanoqwen/quant.py {HOST_TILE_ROWS}")


def check_compiled(module, files) -> None:
    """Raise RuntimeError unless the compiled `module` (of kernel `files`) exports every number of
    SOURCES that those files define, with the value read from the source."""
    for name, file in SOURCES.items():
        if file != "common.cuh" and file not in files:
            continue
        compiled, source = module_int(module, f"abi_{name}"), kernel_int(file, name)
        if compiled != source:
            raise RuntimeError(f"the compiled kernels hold {name} = {compiled}, kernels/{file} says {source}")
