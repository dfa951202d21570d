"""Path A of chapter 8: INT8 activations and __dp4a for the INT4 projections.

The engine's projections keep activations in fp16 (Path B, `kernels/gemv_int4.cu`). Path A
quantizes the activation vector to INT8 first, so that one `__dp4a` multiplies four INT4
weights by four INT8 activations into an int32. This module holds its numpy oracle, which
computes the kernel's result bit for bit, and the CuPy launcher of `kernels/gemv_int4_int8.cu`.

    q, xscale = quantize_activations_int8(x)      # fp16 [K] -> int8 [K], f32 [K/128]
    y = int4_int8_linear(q, xscale, linear)       # -> f32 [N]

    gemv = Int8Gemv(config, qweight, scales, bias)   # cupy arrays; scratch allocated once
    gemv(x, y)                                       # two launches on the current stream

Activations:  scale = max|x| / 127 per group of 128 (fp32),  q = clip(rint(x / scale), -127, 127).
The kernel reads q in PAIR_ORDER, the byte order that lines each activation up with its
weight nibble inside `__dp4a` (see `signed_weight_bytes` and the kernel's header comment).
"""

from __future__ import annotations

import functools

import numpy as np

from ..config import GROUP_SIZE, ModelConfig
from ..loader import Int4Linear
from ..quant import unpack_int4
from .launch import StepKernel

ACT_QMAX = 127  # symmetric INT8: -128 is never produced, so +-max|x| map exactly
# Byte p of every chunk of eight stored activations holds element PAIR_ORDER[p] of the chunk:
# the order in which the kernel's two signed-byte operands of a weight word list their elements.
PAIR_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
# The kernel sums a row's groups in ROW_SLOTS interleaved fp32 accumulators (one per quad of
# lanes, see kernels/gemv_int4_int8.cu), then adds them as (s0 + s1) + (s2 + s3).
ROW_SLOTS = 4
KERNEL_FILE = "gemv_int4_int8.cu"


# ----------------------------------------------------------------------------- the oracle


def quantize_activations_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp16 [K] -> (q int8 [K] in element order, scales float32 [K/128]).

    Every step is one correctly rounded float32 operation, as in the kernel: max|x| is exact,
    scale = max|x| / 127, q = rint(x / scale) (ties to even). A group of zeros has scale 0, q 0.
    """
    x = np.asarray(x)
    _check_activations(x)
    groups = x.astype(np.float32).reshape(-1, GROUP_SIZE)
    scales = np.abs(groups).max(axis=1) / np.float32(ACT_QMAX)
    safe = np.where(scales == 0, np.float32(1), scales)[:, None]
    q = np.clip(np.rint(groups / safe), -ACT_QMAX, ACT_QMAX).astype(np.int8)
    return q.reshape(-1), scales.astype(np.float32)


def to_pair_order(q: np.ndarray) -> np.ndarray:
    """int8 [K] in element order -> int8 [K] as the GEMV reads it (what the quantize kernel writes)."""
    if q.ndim != 1 or q.shape[0] % 8:
        raise ValueError(f"activations must be 1-D with a length divisible by 8, got shape {q.shape}")
    return q.reshape(-1, 8)[:, list(PAIR_ORDER)].reshape(-1)


def signed_weight_bytes(qweight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's unpacking, bit for bit: uint32 [N, K/8] -> (lo, hi) int8 [N, K/8, 4].

        lo = ((w << 4) & 0xF0F0F0F0) ^ 0x80808080   bytes 16 * (q0, q4, q1, q5)
        hi = ( w       & 0xF0F0F0F0) ^ 0x80808080   bytes 16 * (q2, q6, q3, q7)

    Byte i of lo multiplies stored activation byte i of the word's chunk, byte i of hi
    multiplies byte 4 + i: together they list the elements in PAIR_ORDER.
    """
    w = np.ascontiguousarray(qweight, dtype=np.uint32)
    lo = ((w << np.uint32(4)) & np.uint32(0xF0F0F0F0)) ^ np.uint32(0x80808080)
    hi = (w & np.uint32(0xF0F0F0F0)) ^ np.uint32(0x80808080)
    as_bytes = lambda words: words.astype("<u4").view(np.int8).reshape(*w.shape, 4)  # noqa: E731
    return as_bytes(lo), as_bytes(hi)


def int4_int8_linear(q: np.ndarray, scales: np.ndarray, linear: Int4Linear) -> np.ndarray:
    """(q int8 [K] element order, scales f32 [K/128], INT4 [N, K]) -> y float32 [N].

    Exactly the kernel's arithmetic: an exact integer dot product per group, one float32
    term per group, isum * (wscale * xscale), then the groups summed in the kernel's order.
    """
    q = np.asarray(q)
    scales = np.asarray(scales)
    out_features, in_features = linear.out_features, linear.in_features
    groups = in_features // GROUP_SIZE
    if q.dtype != np.int8 or q.shape != (in_features,):
        raise ValueError(f"q must be int8 [{in_features}], got {q.dtype} {q.shape}")
    if scales.dtype != np.float32 or scales.shape != (groups,):
        raise ValueError(f"activation scales must be float32 [{groups}], got {scales.dtype} {scales.shape}")
    weights = unpack_int4(linear.qweight).reshape(out_features, groups, GROUP_SIZE)
    group_dots = np.einsum("ngk,gk->ng", weights, q.reshape(groups, GROUP_SIZE), dtype=np.int32)
    # |group dot| <= 8 * 127 * 128 < 2^24: the conversion to float32 is exact.
    terms = group_dots.astype(np.float32) * (linear.scales.astype(np.float32) * scales[None, :])
    slots = np.zeros((ROW_SLOTS, out_features), dtype=np.float32)
    for g in range(groups):  # left to right, as each lane quad adds its groups
        slots[g % ROW_SLOTS] += terms[:, g]
    y = (slots[0] + slots[1]) + (slots[2] + slots[3])
    if linear.bias is not None:
        y += linear.bias.astype(np.float32)
    return y


def _check_activations(x: np.ndarray) -> None:
    if x.dtype != np.float16 or x.ndim != 1:
        raise ValueError(f"activations must be a 1-D float16 vector, got {x.dtype} with shape {x.shape}")
    if x.shape[0] == 0 or x.shape[0] % GROUP_SIZE:
        raise ValueError(f"activation length {x.shape[0]} is not a positive multiple of the group size {GROUP_SIZE}")


# ----------------------------------------------------------------------------- the GPU path


@functools.lru_cache(maxsize=None)
def compiled_module(config: ModelConfig):
    """kernels/gemv_int4_int8.cu compiled for one model's widths (once per config)."""
    from . import build as cuda_build

    return cuda_build.compile_module(config, files=(KERNEL_FILE,))


def width_name(config: ModelConfig, in_features: int) -> str:
    """The kernel suffix for an input width: hidden, q_dim or intermediate."""
    for name, width in (("hidden", config.hidden_size), ("q_dim", config.q_dim), ("intermediate", config.intermediate_size)):
        if in_features == width:
            return name
    raise ValueError(
        f"input length {in_features} is none of this model's projection inputs "
        f"(hidden {config.hidden_size}, q_dim {config.q_dim}, intermediate {config.intermediate_size})"
    )


# Launch geometry, fixed by the kernel's constants (QUANT_WARPS, GEMV_THREADS, LANES_PER_ROW).
QUANT_THREADS = 128
QUANT_GROUPS_PER_BLOCK = QUANT_THREADS // 32
GEMV_THREADS = 128
GEMV_ROWS_PER_BLOCK = GEMV_THREADS // 16


class Int8Gemv:
    """Path A for one INT4 projection on the GPU: y f32 [N] = W [N, K] . int8(x f16 [K]).

    The INT8 activations and their scales live in buffers allocated here, once, so a call
    only launches kernels (on the current CuPy stream) and can be captured in a CUDA graph.
    Projections that share an input can share one quantization: call `quantize` once, then
    `gemv` on each.
    """

    def __init__(self, config: ModelConfig, qweight, scales, bias=None):
        import cupy

        _check_gpu_array("qweight", qweight, cupy.uint32, 2, alignment=16)
        out_features, words = qweight.shape
        if out_features == 0:
            raise ValueError("qweight has no rows")
        in_features = words * 8
        suffix = width_name(config, in_features)
        _check_gpu_array("scales", scales, cupy.float16, 2)
        if scales.shape != (out_features, in_features // GROUP_SIZE):
            raise ValueError(f"scales must be [{out_features}, {in_features // GROUP_SIZE}], got {scales.shape}")
        if bias is not None:
            _check_gpu_array("bias", bias, cupy.float16, 1)
            if bias.shape != (out_features,):
                raise ValueError(f"bias must be [{out_features}], got {bias.shape}")
        self.qweight, self.scales, self.bias = qweight, scales, bias
        self.out_features, self.in_features = out_features, in_features
        module = compiled_module(config)
        # Plain launches, except inside the decode graph's capture (nanoqwen.cuda.launch).
        self._quantize_kernel = StepKernel(module.get_function(f"quantize_activations_int8_{suffix}"),
                                           f"quantize_activations_int8_{suffix}")
        self._gemv_kernel = StepKernel(module.get_function(f"gemv_int4_int8_{suffix}"), f"gemv_int4_int8_{suffix}")
        self.xq = cupy.empty(in_features, dtype=cupy.int8)  # pair order
        self.xscale = cupy.empty(in_features // GROUP_SIZE, dtype=cupy.float32)
        groups = in_features // GROUP_SIZE
        self._quantize_grid = (-(-groups // QUANT_GROUPS_PER_BLOCK),)
        self._gemv_grid = (-(-out_features // GEMV_ROWS_PER_BLOCK),)
        # CuPy passes None as an invalid address, not NULL; a 64-bit zero is the null pointer.
        self._bias_arg = bias if bias is not None else np.uint64(0)

    def quantize(self, x) -> None:
        """x fp16 [K] -> self.xq, self.xscale."""
        import cupy

        _check_gpu_array("x", x, cupy.float16, 1, alignment=8)
        if x.shape != (self.in_features,):
            raise ValueError(f"x must be [{self.in_features}], got {x.shape}")
        self._quantize_kernel(self._quantize_grid, (QUANT_THREADS,), (x, self.xq, self.xscale))

    def gemv(self, out) -> None:
        """self.xq, self.xscale -> out f32 [N]."""
        import cupy

        _check_gpu_array("out", out, cupy.float32, 1)
        if out.shape != (self.out_features,):
            raise ValueError(f"out must be [{self.out_features}], got {out.shape}")
        self._gemv_kernel(
            self._gemv_grid,
            (GEMV_THREADS,),
            (self.qweight, self.scales, self.xq, self.xscale, self._bias_arg, out, np.int32(self.out_features)),
        )

    def __call__(self, x, out):
        self.quantize(x)
        self.gemv(out)
        return out


def _check_gpu_array(name: str, array, dtype, ndim: int, alignment: int = 4) -> None:
    """A C-contiguous cupy array of this dtype and rank, starting on an `alignment`-byte
    boundary (the kernels read qweight 16 and x 8 bytes at a time)."""
    import cupy

    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(array).__name__}")
    if array.dtype != dtype or array.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D {np.dtype(dtype).name} array, got {array.dtype} {array.shape}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous: the kernels index raw memory")
    if array.data.ptr % alignment:
        raise ValueError(f"{name} must start on a {alignment}-byte boundary (the kernels load {alignment} bytes at once)")
