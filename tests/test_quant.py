"""INT4 group-wise quantization: the error bound, the packed layout and the fp16 unpack trick."""

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from nanoqwen.quant import (
    NIBBLE_OF_ELEMENT, QMAX, TILE_ROWS, ZERO_POINT, dequantize_int4, quantize_int4, tile_int4, unpack_int4,
)

FP16_MAX = float(np.finfo(np.float16).max)  # 65504
FP16_TINY = float(np.finfo(np.float16).smallest_subnormal)  # 2**-24


def assert_within_bound(weight: np.ndarray, qweight: np.ndarray, scales: np.ndarray) -> None:
    """|w - w'| <= scale / 2 element-wise, in float64 so the check adds no rounding of its own.

    The only slack is float32's rounding of w / scale before `rint` (a few 1e-7 relative)."""
    w = weight.astype(np.float64)
    q = unpack_int4(qweight).astype(np.float64)
    scale = np.repeat(scales.astype(np.float64), w.shape[1] // scales.shape[1], axis=1)
    error = np.abs(w - q * scale)
    bound = scale / 2 * (1 + 1e-6)
    worst = np.unravel_index(np.argmax(error - bound), w.shape)
    assert (error <= bound).all(), f"w={w[worst]!r} q={q[worst]} scale={scale[worst]!r} error={error[worst]!r}"
    assert (np.abs(q) <= QMAX).all(), "q = -8 (nibble 0) must never be stored"


def weights(rng, out_features, in_features, kind):
    w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.02
    if kind == "outliers":  # a few huge values per row, as in real attention projections
        rows = np.arange(out_features)
        w[rows, rng.integers(0, in_features, out_features)] = rng.choice([-1, 1], out_features) * 3.0
    elif kind == "zero_groups":
        w[:, 128:256] = 0
        w[0, :] = 0
    elif kind == "fp16_max":
        w[:, ::128] = FP16_MAX
        w[:, 1::128] = -FP16_MAX
    elif kind == "fp16_subnormal":  # scales land among fp16 subnormals, where rounding is coarse
        w *= 1e-4 / 0.02 * rng.choice([1e-4, 1e-3, 1e-2, 1e-1, 1.0], (out_features, 1))
    elif kind == "mixed_magnitudes":
        w *= 10.0 ** rng.integers(-9, 5, (out_features, in_features // 128)).repeat(128, axis=1)
    return w


@pytest.mark.parametrize("kind", ["normal", "outliers", "zero_groups", "fp16_max", "fp16_subnormal", "mixed_magnitudes"])
@pytest.mark.parametrize("shape", [(1, 128), (7, 256), (33, 384), (64, 1024)])
def test_round_trip_within_bound(kind, shape):
    rng = np.random.default_rng(zlib.crc32(repr((kind, shape)).encode()))
    w = weights(rng, *shape, kind)
    qweight, scales = quantize_int4(w)
    assert qweight.dtype == np.uint32 and qweight.shape == (shape[0], shape[1] // 8)
    assert scales.dtype == np.float16 and scales.shape == (shape[0], shape[1] // 128)
    assert np.isfinite(scales).all() and (scales >= 0).all()
    assert_within_bound(w, qweight, scales)
    np.testing.assert_array_equal(
        dequantize_int4(qweight, scales),
        unpack_int4(qweight).astype(np.float32) * np.repeat(scales.astype(np.float32), 128, axis=1),
    )


@settings(max_examples=300, deadline=None)
@given(
    arrays(
        np.float32,
        st.tuples(st.integers(1, 4), st.integers(1, 3).map(lambda g: 128 * g)),
        elements=st.floats(-FP16_MAX, FP16_MAX, width=32),
    )
)
def test_bound_holds_for_any_fp16_range_values(w):
    """Hypothesis hunts for the nastiest groups: subnormals, ties, a lone extreme value."""
    qweight, scales = quantize_int4(w)
    assert_within_bound(w, qweight, scales)


def test_scale_is_max_over_7_rounded_to_fp16_in_the_normal_range():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 512)).astype(np.float32)
    qweight, scales = quantize_int4(w)
    amax = np.abs(w.reshape(16, 4, 128)).max(axis=-1)
    np.testing.assert_array_equal(scales, (amax / 7).astype(np.float16))
    q = unpack_int4(qweight).reshape(16, 4, 128)
    # the largest element of each group lands on +-7: the full range is used
    assert (np.abs(q).max(axis=-1) == QMAX).all()


def test_zero_group_has_scale_zero_and_nibbles_eight():
    w = np.zeros((3, 256), np.float32)
    w[1, 200] = 0.5
    qweight, scales = quantize_int4(w)
    assert scales[0, 0] == 0 and scales[0, 1] == 0 and scales[1, 0] == 0 and scales[1, 1] > 0
    assert (qweight[0] == 0x88888888).all() and (qweight[1, :16] == 0x88888888).all()
    assert (dequantize_int4(qweight, scales)[0] == 0).all()


def test_subnormal_scale_is_raised_instead_of_clipping():
    # max|w| / 7 = 8.86e-8 rounds to the fp16 subnormal 5.96e-8, where 6.2e-7 / scale = 10.4
    # would clip at 7; the quantizer takes the next fp16 step, 1.19e-7, instead.
    w = np.zeros((1, 128), np.float32)
    w[0, 0], w[0, 1] = 6.2e-7, -3e-7
    qweight, scales = quantize_int4(w)
    assert scales[0, 0] == np.float16(2 * FP16_TINY)
    assert_within_bound(w, qweight, scales)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 7 * 65520.0])
def test_refuses_values_no_fp16_scale_can_hold(bad):
    w = np.zeros((2, 128), np.float32)
    w[1, 5] = bad
    with pytest.raises(ValueError, match="NaN, Inf or magnitudes"):
        quantize_int4(w)


def test_refuses_input_dimension_not_multiple_of_group():
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        quantize_int4(np.ones((2, 100), np.float32))


def reference_pack(q: np.ndarray) -> np.ndarray:
    """Pack signed q [out, in] the slow way, straight from the contract's words."""
    out_features, in_features = q.shape
    words = np.zeros((out_features, in_features // 8), np.uint32)
    for r in range(out_features):
        for j in range(in_features // 8):
            word = 0
            for e in range(8):  # element e of the word sits in nibble NIBBLE_OF_ELEMENT[e]
                word |= (int(q[r, 8 * j + e]) + 8) << (4 * NIBBLE_OF_ELEMENT[e])
            words[r, j] = word
    return words


def test_packed_layout_matches_the_contract():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((5, 256)).astype(np.float32)
    qweight, scales = quantize_int4(w)
    q = unpack_int4(qweight)
    np.testing.assert_array_equal(reference_pack(q), qweight)
    assert NIBBLE_OF_ELEMENT == (0, 4, 1, 5, 2, 6, 3, 7) and ZERO_POINT == 8


def test_word_of_known_elements():
    # elements 0..7 = q -7, -6, ..., 0 -> nibbles 1..8; element e in nibble (0,4,1,5,2,6,3,7)[e]
    q = np.tile(np.arange(-7, 1, dtype=np.int8), (1, 16))  # one row of 128 elements
    w = q.astype(np.float32)
    qweight, scales = quantize_int4(w)
    assert scales[0, 0] == 1
    nibbles = {NIBBLE_OF_ELEMENT[e]: e + 1 for e in range(8)}
    expected = sum(nibbles[n] << (4 * n) for n in range(8))
    # even elements (nibbles 1,3,5,7) fill the low half-word, odd ones (2,4,6,8) the high half
    assert expected == 0x86427531
    assert (qweight == expected).all()


def fp16_pairs_from_word(words: np.ndarray) -> np.ndarray:
    """Simulate the GPU unpack: per i, (word >> 4i) & 0x000F000F | 0x64006400 is a half2 of
    (1024 + nibble); subtracting the half2 0x64086408 = (1032, 1032) leaves the signed value.
    Returns float16 [..., 8] in element order."""
    magic = np.array([0x64086408], np.uint32).view(np.float16)  # [1032, 1032]
    out = []
    for i in range(4):
        halves = ((words >> np.uint32(4 * i)) & np.uint32(0x000F000F)) | np.uint32(0x64006400)
        pair = halves[..., None].view(np.float16)  # little-endian: low half first = element 2i
        out.append(pair - magic)  # fp16 subtraction, exact: both operands are integers < 2048
    return np.concatenate(out, axis=-1)


def test_fp16_magic_number_unpack_is_exact_for_every_nibble_pair():
    lo, hi = np.meshgrid(np.arange(16, dtype=np.uint32), np.arange(16, dtype=np.uint32), indexing="ij")
    lo, hi = lo.ravel(), hi.ravel()
    for i in range(4):  # put the pair at elements (2i, 2i+1): nibbles i and i+4
        words = (lo << np.uint32(4 * i)) | (hi << np.uint32(4 * (i + 4)))
        values = fp16_pairs_from_word(words)
        assert values.dtype == np.float16
        np.testing.assert_array_equal(values[:, 2 * i], lo.astype(np.float16) - 8)
        np.testing.assert_array_equal(values[:, 2 * i + 1], hi.astype(np.float16) - 8)
    assert np.array([0x64006400], np.uint32).view(np.float16).tolist() == [1024.0, 1024.0]


def test_fp16_unpack_gives_elements_in_activation_order():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((9, 384)).astype(np.float32)
    qweight, scales = quantize_int4(w)
    values = fp16_pairs_from_word(qweight).reshape(9, 384)
    np.testing.assert_array_equal(values.astype(np.int8), unpack_int4(qweight))
    np.testing.assert_array_equal(
        values.astype(np.float32) * np.repeat(scales.astype(np.float32), 128, axis=1),
        dequantize_int4(qweight, scales),
    )


# ---------------------------------------------------------------------- the decode layout


@pytest.mark.parametrize("rows", [48, 1000, 7, 2 * 18944])
def test_tile_int4_puts_every_word_where_the_kernels_look(rows):
    """Row r, word w at [r // 16, w // 16, r % 16, w % 16]; the padding rows of the last tile
    hold zero words."""
    rng = np.random.default_rng(rows)
    qweight = rng.integers(1, 2**32, (rows, 384 // 8), dtype=np.uint32)  # never 0: padding is
    tiled = tile_int4(qweight)
    tiles = -(-rows // TILE_ROWS)
    assert tiled.shape == (tiles, 3, TILE_ROWS, 16) and tiled.flags.c_contiguous
    row = np.arange(rows)
    assert (tiled[row // TILE_ROWS, :, row % TILE_ROWS, :].reshape(rows, -1) == qweight).all()
    assert (tiled.transpose(0, 2, 1, 3).reshape(tiles * TILE_ROWS, -1)[rows:] == 0).all()


def test_tile_int4_refuses_rows_of_partial_groups():
    with pytest.raises(ValueError, match="not whole groups"):
        tile_int4(np.zeros((10, 40), dtype=np.uint32))
