"""Path A (INT8 activations, __dp4a): the oracle and its bit tricks on the CPU, the kernels of
kernels/gemv_int4_int8.cu against the oracle on the GPU, bit for bit.

On a GPU machine without nbval (tests/conftest.py imports it), run this file alone with
    python3 -m pytest -q --noconftest -o addopts="" tests/test_int8_path.py
"""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen.book.int8_study import (
    dequantized_reference,
    error_vs_reference,
    synthetic_activations,
    synthetic_projection,
)
from nanoqwen.config import GROUP_SIZE, ModelConfig
from nanoqwen.cuda.int8 import (
    ACT_QMAX,
    PAIR_ORDER,
    Int8Gemv,
    int4_int8_linear,
    quantize_activations_int8,
    signed_weight_bytes,
    to_pair_order,
)
from nanoqwen.loader import Int4Linear
from nanoqwen.quant import NIBBLE_OF_ELEMENT, dequantize_int4, unpack_int4
from nanoqwen.random_model import QWEN25_CODER_7B

# The projections of Qwen2.5-Coder-7B: (name, out_features N, in_features K).
SHAPES_7B = [
    ("k or v", 512, 3584),
    ("q or o", 3584, 3584),
    ("fused qkv", 4608, 3584),
    ("fused gate+up", 37888, 3584),
    ("down", 3584, 18944),
]


def small_config(hidden: int, intermediate: int, num_heads: int) -> ModelConfig:
    """A model whose three projection input widths are hidden, 128 * num_heads, intermediate."""
    return ModelConfig(
        num_layers=1, hidden_size=hidden, intermediate_size=intermediate, num_heads=num_heads, num_kv_heads=1,
        head_dim=128, vocab_size=256, max_position_embeddings=64, rope_theta=1e4, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


# Odd widths (K/32 chunks not a multiple of the 16 lanes of a row, so some lanes idle; one
# group) in two configs, and odd row counts: one row, rows that do not fill a block of 8.
ODD_A = small_config(hidden=640, intermediate=1152, num_heads=3)  # widths 640, 384, 1152
ODD_B = small_config(hidden=3712, intermediate=128, num_heads=1)  # widths 3712, 128
SHAPES_ODD = [(ODD_B, 1, 128), (ODD_A, 13, 384), (ODD_A, 37, 640), (ODD_A, 9, 1152), (ODD_B, 3, 3712)]


def _gpu_status() -> tuple[bool, str]:
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, no driver, no device
        return False, f"{type(exc).__name__}: {exc}"
    return count > 0, f"{count} CUDA device(s)"


_GPU_OK, _GPU_WHY = _gpu_status()
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not _GPU_OK, reason=f"needs CuPy and a CUDA GPU ({_GPU_WHY})")


def random_linear(out_features: int, in_features: int, rng: np.random.Generator, bias: bool = False) -> Int4Linear:
    """Any uint32 words (every nibble value 0..15, so q = -8 too) and positive fp16 scales."""
    qweight = rng.integers(0, 2**32, (out_features, in_features // 8), dtype=np.uint32)
    scales = rng.uniform(1e-3, 2e-2, (out_features, in_features // GROUP_SIZE)).astype(np.float16)
    b = rng.standard_normal(out_features).astype(np.float16) if bias else None
    return Int4Linear(qweight, scales, b)


# ----------------------------------------------------------------------------- CPU: oracle


@pytest.mark.parametrize("in_features", [128, 640, 3584, 18944])
def test_quantized_activations_are_within_half_a_step(in_features):
    rng = np.random.default_rng(in_features)
    x = synthetic_activations(in_features, rng)
    q, scales = quantize_activations_int8(x)
    assert q.dtype == np.int8 and q.shape == (in_features,)
    assert scales.dtype == np.float32 and scales.shape == (in_features // GROUP_SIZE,)
    groups = x.astype(np.float32).reshape(-1, GROUP_SIZE)
    qg = q.reshape(-1, GROUP_SIZE).astype(np.float32)
    assert np.abs(q).max() <= ACT_QMAX
    assert (np.abs(qg).max(axis=1) == ACT_QMAX).all(), "every group's largest element must map to +-127"
    # rint(x / scale) is off by at most 1/2 step, plus the rounding of x / scale itself.
    error = np.abs(groups - qg * scales[:, None])
    assert (error <= scales[:, None] * (0.5 + 1e-6)).all()


def test_quantize_rounds_ties_to_even_and_zero_groups_to_zero():
    x = np.zeros(2 * GROUP_SIZE, dtype=np.float16)
    x[:6] = [127.0, 0.5, 1.5, 2.5, -0.5, -2.5]  # max|x| = 127: scale 1, so x / scale is exact
    q, scales = quantize_activations_int8(x)
    assert scales.tolist() == [1.0, 0.0]
    assert q[:6].tolist() == [127, 0, 2, 2, 0, -2]
    assert not q[6:].any()


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.zeros(128, np.float32), "float16"),
        (np.zeros((2, 128), np.float16), "1-D"),
        (np.zeros(100, np.float16), "multiple of the group size"),
        (np.zeros(0, np.float16), "multiple of the group size"),
    ],
)
def test_quantize_rejects_bad_input(bad, message):
    with pytest.raises(ValueError, match=message):
        quantize_activations_int8(bad)


def test_signed_weight_bytes_for_every_nibble_in_every_position():
    """Each nibble value 0..15 (q = -8..7) of each element lands as the signed byte 16q at
    the byte position where PAIR_ORDER puts that element's activation."""
    for element in range(8):
        for nibble in range(16):
            word = np.uint32(0x88888888)  # every element q = 0
            shift = 4 * NIBBLE_OF_ELEMENT[element]
            word = (word & ~np.uint32(0xF << shift)) | np.uint32(nibble << shift)
            lo, hi = signed_weight_bytes(np.array([[word]], dtype=np.uint32))
            operands = np.concatenate([lo[0, 0], hi[0, 0]]).astype(np.int32)  # stored bytes 0..7
            expected = np.zeros(8, np.int32)
            expected[PAIR_ORDER.index(element)] = 16 * (nibble - 8)
            np.testing.assert_array_equal(operands, expected, err_msg=f"element {element}, nibble {nibble}")


def test_dp4a_pairing_gives_the_exact_dot_product():
    """Emulate the kernel: dp4a(lo, stored bytes 0..3) + dp4a(hi, stored bytes 4..7) per word
    equals 16 x the dot of unpacked weights and activations in element order."""
    rng = np.random.default_rng(7)
    linear = random_linear(24, 1024, rng)
    q = rng.integers(-ACT_QMAX, ACT_QMAX + 1, 1024, dtype=np.int8)
    lo, hi = signed_weight_bytes(linear.qweight)
    stored = to_pair_order(q).reshape(-1, 2, 4).astype(np.int32)  # [K/8, (lo, hi), 4]
    dp4a = (lo * stored[None, :, 0]).sum(-1, dtype=np.int32) + (hi * stored[None, :, 1]).sum(-1, dtype=np.int32)
    unpacked = (unpack_int4(linear.qweight).reshape(24, -1, 8).astype(np.int32) * q.reshape(-1, 8)).sum(-1)
    np.testing.assert_array_equal(dp4a, 16 * unpacked)


def test_pair_order_is_a_permutation_of_each_chunk():
    q = np.arange(16, dtype=np.int8)
    assert to_pair_order(q).tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


def test_oracle_is_the_group_wise_integer_formula():
    """int4_int8_linear = sum_g (integer dot of group g) * wscale * xscale, up to float32
    summation order (compared against the same formula in float64)."""
    rng = np.random.default_rng(3)
    linear = random_linear(40, 1152, rng, bias=True)
    q, xscale = quantize_activations_int8(synthetic_activations(1152, rng))
    y = int4_int8_linear(q, xscale, linear)
    w = unpack_int4(linear.qweight).astype(np.int64).reshape(40, -1, GROUP_SIZE)
    dots = (w * q.reshape(-1, GROUP_SIZE)).sum(-1)
    expected = (dots * linear.scales.astype(np.float64) * xscale.astype(np.float64)).sum(1) + linear.bias
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("in_features", [3584, 18944])
def test_oracle_error_vs_dequantized_reference_is_bounded(in_features, record_property):
    """Path A's only new error is the activation rounding: |x - q*s| <= s/2 per element, so
    |y_A - y_ref| <= sum_k |w_k| * s_g(k) / 2 (+ float32 rounding). Checked per output, and
    the relative error reported."""
    rng = np.random.default_rng(in_features)
    rows = 512  # the bound is per row: 512 rows of the 7B's input widths show it
    linear, _ = synthetic_projection(rows, in_features, rng)
    x = synthetic_activations(in_features, rng)
    q, xscale = quantize_activations_int8(x)
    y = int4_int8_linear(q, xscale, linear)
    reference = dequantized_reference(x, linear)
    weights = np.abs(dequantize_int4(linear.qweight, linear.scales)).astype(np.float64)
    bound = weights @ np.repeat(xscale.astype(np.float64) / 2, GROUP_SIZE)
    slack = 1e-5 * (weights @ np.abs(x.astype(np.float64)))
    assert (np.abs(y - reference) <= bound + slack).all()
    error = error_vs_reference(y, reference)
    record_property("rel_l2", error["rel_l2"])
    print(f"{rows}x{in_features}: Path A rel. L2 error {error['rel_l2']:.2e}, max {error['max_rel']:.2e}")
    assert error["rel_l2"] < 0.05, error  # the synthetic activations (outlier channels) give about 2%


def test_oracle_rejects_mismatched_inputs():
    rng = np.random.default_rng(0)
    linear = random_linear(4, 256, rng)
    q, s = quantize_activations_int8(synthetic_activations(256, rng))
    with pytest.raises(ValueError, match="q must be int8"):
        int4_int8_linear(q[:128], s, linear)
    with pytest.raises(ValueError, match="q must be int8"):
        int4_int8_linear(q.astype(np.int16), s, linear)
    with pytest.raises(ValueError, match="activation scales"):
        int4_int8_linear(q, s.astype(np.float16), linear)


# ----------------------------------------------------------------------------- GPU: kernels


def _to_gpu(linear: Int4Linear):
    import cupy

    bias = None if linear.bias is None else cupy.asarray(linear.bias)
    return cupy.asarray(linear.qweight), cupy.asarray(linear.scales), bias


def _poisoned(shape, dtype, value):
    import cupy

    return cupy.full(shape, value, dtype=dtype)


@gpu
@needs_gpu
@pytest.mark.parametrize(
    "config, in_features",
    [(ODD_B, 128), (ODD_A, 384), (ODD_A, 640), (ODD_A, 1152), (QWEN25_CODER_7B, 3584), (QWEN25_CODER_7B, 18944)],
    ids=["128", "384", "640", "1152", "3584", "18944"],
)
def test_quantize_kernel_matches_oracle(config, in_features):
    import cupy

    rng = np.random.default_rng(100 + in_features)
    x = synthetic_activations(in_features, rng)
    if in_features > GROUP_SIZE:
        x[GROUP_SIZE : 2 * GROUP_SIZE] = 0  # an all-zero group: scale 0
    x[:6] = [127.0, 0.5, 1.5, 2.5, -0.5, -2.5]  # ties, with scale exactly 1
    x[6:GROUP_SIZE] = np.clip(x[6:GROUP_SIZE], -100, 100)
    gemv = Int8Gemv(config, *_to_gpu(random_linear(8, in_features, rng)))
    gemv.xq[...] = -128  # never written by the quantizer (it clips to +-127)
    gemv.xscale[...] = np.nan
    gemv.quantize(cupy.asarray(x))
    q, scales = quantize_activations_int8(x)
    np.testing.assert_array_equal(cupy.asnumpy(gemv.xscale), scales)
    np.testing.assert_array_equal(cupy.asnumpy(gemv.xq), to_pair_order(q))


@gpu
@needs_gpu
@pytest.mark.parametrize(
    "config, out_features, in_features",
    [(QWEN25_CODER_7B, n, k) for _, n, k in SHAPES_7B] + SHAPES_ODD,
    ids=[s[0].replace(" ", "_") for s in SHAPES_7B] + [f"{n}x{k}" for _, n, k in SHAPES_ODD],
)
def test_gemv_matches_oracle_bit_for_bit(config, out_features, in_features):
    import cupy

    rng = np.random.default_rng(out_features * 7 + in_features)
    linear = random_linear(out_features, in_features, rng, bias=out_features % 2 == 1)
    gemv = Int8Gemv(config, *_to_gpu(linear))
    y = _poisoned(out_features, cupy.float32, np.nan)
    for trial in range(2):  # fresh activations each time: no state may leak between calls
        x = synthetic_activations(in_features, rng)
        y[...] = np.nan
        gemv(cupy.asarray(x), y)
        q, xscale = quantize_activations_int8(x)
        expected = int4_int8_linear(q, xscale, linear)
        got = cupy.asnumpy(y)
        assert not np.isnan(got).any(), f"{np.isnan(got).sum()} outputs never written"
        diff = np.abs(got - expected)
        np.testing.assert_array_equal(
            got, expected, err_msg=f"trial {trial}: max |diff| {diff.max():.3e} at row {diff.argmax()}"
        )


@gpu
@needs_gpu
def test_gemv_on_a_realistic_projection_tracks_the_reference():
    import cupy

    rng = np.random.default_rng(11)
    linear, _ = synthetic_projection(512, 3584, rng, bias=True)
    x = synthetic_activations(3584, rng)
    y = _poisoned(512, cupy.float32, np.nan)
    Int8Gemv(QWEN25_CODER_7B, *_to_gpu(linear))(cupy.asarray(x), y)
    got = cupy.asnumpy(y)
    q, xscale = quantize_activations_int8(x)
    np.testing.assert_array_equal(got, int4_int8_linear(q, xscale, linear))
    assert error_vs_reference(got, dequantized_reference(x, linear))["rel_l2"] < 0.05


@gpu
@needs_gpu
def test_gemv_replays_from_a_cuda_graph():
    """Captured once, replayed on new activations copied into the same input buffer."""
    import cupy

    rng = np.random.default_rng(12)
    linear = random_linear(4608, 3584, rng)
    gemv = Int8Gemv(QWEN25_CODER_7B, *_to_gpu(linear))
    x_gpu = cupy.asarray(synthetic_activations(3584, rng))
    y = _poisoned(4608, cupy.float32, np.nan)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        gemv(x_gpu, y)  # compile and load outside the capture
        stream.begin_capture()
        gemv(x_gpu, y)
        graph = stream.end_capture()
    for _ in range(2):
        x = synthetic_activations(3584, rng)
        x_gpu.set(x, stream=stream)
        y.fill(np.nan)  # on the null stream, ordered before the replay by the sync below
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        q, xscale = quantize_activations_int8(x)
        np.testing.assert_array_equal(cupy.asnumpy(y), int4_int8_linear(q, xscale, linear))


@gpu
@needs_gpu
def test_launcher_rejects_bad_arrays():
    import cupy

    rng = np.random.default_rng(13)
    qweight, scales, _ = _to_gpu(random_linear(16, 640, rng))
    with pytest.raises(TypeError, match="cupy.ndarray"):
        Int8Gemv(ODD_A, cupy.asnumpy(qweight), scales)
    with pytest.raises(ValueError, match="none of this model's projection inputs"):
        Int8Gemv(ODD_B, qweight, scales)
    with pytest.raises(ValueError, match="scales must be"):
        Int8Gemv(ODD_A, qweight, scales[:, :1].copy())
    with pytest.raises(ValueError, match="float16"):
        Int8Gemv(ODD_A, qweight, scales.astype(cupy.float32))
    with pytest.raises(ValueError, match="bias must be"):
        Int8Gemv(ODD_A, qweight, scales, cupy.zeros(15, cupy.float16))
    gemv = Int8Gemv(ODD_A, qweight, scales)
    with pytest.raises(ValueError, match="x must be"):
        gemv(cupy.zeros(128, cupy.float16), cupy.zeros(16, cupy.float32))
    with pytest.raises(ValueError, match="out must be"):
        gemv(cupy.zeros(640, cupy.float16), cupy.zeros(17, cupy.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        gemv(cupy.zeros(1280, cupy.float16)[::2], cupy.zeros(16, cupy.float32))
    with pytest.raises(ValueError, match="8-byte boundary"):
        gemv(cupy.zeros(641, cupy.float16)[1:], cupy.zeros(16, cupy.float32))
