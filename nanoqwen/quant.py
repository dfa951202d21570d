"""Symmetric group-wise INT4 quantization and the packed layout the GPU GEMV reads.

Shapes follow Hugging Face: a linear weight is [out, in]; groups run along `in`.

    scale  = max|w| / 7            per group of 128 inputs, stored as fp16
    q      = round(w / scale)      in [-7, 7]
    nibble = q + 8                 in [1, 15], four bits
    w'     = (nibble - 8) * scale  so |w - w'| <= scale / 2

Eight nibbles share a uint32 word, *interleaved*: element e of the word lives in nibble
NIBBLE_OF_ELEMENT[e]. A GPU thread then gets elements (2i, 2i+1) as the two 16-bit halves of
`(word >> 4i) & 0x000F000F`, already in the order of the fp16 activation pairs it multiplies.

The file keeps matrices row-major. The CUDA decode GEMVs read the packed words re-tiled
(`tile_int4`): one warp multiplies 16 rows, so each 16-row tile's words of one input group
(16 rows x 64 bytes) are stored together, and a warp's range of groups is one contiguous run.
"""

from __future__ import annotations

import numpy as np

from .config import GROUP_SIZE

TILE_ROWS = 16  # rows per tile of the decode layout: the rows one warp multiplies (kernels/gemv_int4.cu)

QMAX = 7  # symmetric range [-7, 7]: -8 is left unused so that +-max|w| map exactly
ZERO_POINT = 8
NIBBLE_OF_ELEMENT = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = 4 * np.array(NIBBLE_OF_ELEMENT, dtype=np.uint32)


def quantize_int4(weight: np.ndarray, group_size: int = GROUP_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (qweight uint32 [out, in/8], scales float16 [out, in/group])."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"input dimension {in_features} is not a multiple of the group size {group_size}")
    groups = weight.astype(np.float32).reshape(out_features, in_features // group_size, group_size)
    amax = np.abs(groups).max(axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        scales = (amax / QMAX).astype(np.float16)
    if not np.isfinite(scales).all():
        raise ValueError(
            f"weights hold NaN, Inf or magnitudes above {QMAX} x the fp16 maximum: no fp16 scale can represent them"
        )
    # Among fp16 subnormals a rounded scale can be so far below max|w| / 7 that the largest
    # element would clip (max|w| / scale >= 7.5) and break the scale/2 bound. One fp16 step up
    # always suffices, and never touches a scale in the normal range.
    clips = (amax > 0) & (amax >= 7.5 * scales.astype(np.float32))
    scales = np.where(clips, np.nextafter(scales, np.float16(np.inf)), scales)
    scale32 = scales.astype(np.float32)[..., None]
    safe = np.where(scale32 == 0, 1.0, scale32)  # an all-zero group quantizes to q = 0
    q = np.clip(np.rint(groups / safe), -QMAX, QMAX).astype(np.int8)
    nibbles = (q + ZERO_POINT).astype(np.uint32).reshape(out_features, in_features // 8, 8)
    qweight = np.bitwise_or.reduce(nibbles << _SHIFTS, axis=-1).astype(np.uint32)
    return qweight, scales


def unpack_int4(qweight: np.ndarray) -> np.ndarray:
    """uint32 [out, in/8] -> signed int8 [out, in] in [-8, 7] (the stored q values)."""
    out_features, words = qweight.shape
    nibbles = (qweight[..., None] >> _SHIFTS) & 0xF
    return (nibbles.astype(np.int8) - ZERO_POINT).reshape(out_features, words * 8)


def dequantize_int4(qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(uint32 [out, in/8], float16 [out, in/group]) -> float32 [out, in]."""
    q = unpack_int4(qweight).astype(np.float32)
    out_features, in_features = q.shape
    group_size = in_features // scales.shape[1]
    grouped = q.reshape(out_features, scales.shape[1], group_size) * scales.astype(np.float32)[..., None]
    return grouped.reshape(out_features, in_features)


def tile_int4(qweight, xp=np):
    """The decode layout of packed weights: uint32 [tiles, groups, 16, W] (W = 16 words per row and group).

    qweight uint32 [rows, in/8] is padded with zero rows to a multiple of 16 and cut into 16-row
    tiles; word w of row r lands at [r // 16, w // W, r % 16, w % W]. Projections stacked into one
    matrix (q|k|v, gate|up) stay whole tiles apart, since every stacked size but the last is a
    multiple of 128 (ModelConfig checks it). The scales keep the file's row-major [rows, groups]
    (kernels/gemv_int4.cu says why). `xp` is numpy or cupy: the CUDA backend tiles on the device.
    """
    rows, words = qweight.shape
    words_per_group = GROUP_SIZE // 8
    if words % words_per_group:
        raise ValueError(f"rows of {words} words are not whole groups of {words_per_group}")
    padded = -(-rows // TILE_ROWS) * TILE_ROWS
    tiled = xp.zeros((padded, words), dtype=xp.uint32)
    tiled[:rows] = qweight
    tiled = tiled.reshape(padded // TILE_ROWS, TILE_ROWS, words // words_per_group, words_per_group)
    return xp.ascontiguousarray(tiled.transpose(0, 2, 1, 3))
