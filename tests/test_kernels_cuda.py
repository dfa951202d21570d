"""Every decoder-layer kernel of kernels/ against its numpy oracle, and the CUDA backend
against the numpy backend. Needs CuPy and a GPU (marked `gpu`; skipped otherwise).

Each test draws fresh random inputs (never zeros), poisons every output with NaN before the
launch so an element the kernel forgot stays NaN, and runs at the 7B's shapes and at odd small
ones (hidden 384, intermediate 640, vocab 1003 (not a multiple of 4), rows not a multiple of 16). Tolerances:

* fp32 results of a dot product over K terms: |gpu - exact| <= 2e-5 * sum_k |x_k w_k|
  (fp32 rounding of K-term sums in any order is far below this; a wrong element is not);
* fp16 results: at most one fp16 spacing from the reference, since the kernel's fp32 value
  may differ from numpy's in its last bits and round to the neighbouring half;
* values that only move or add (embedding, residual, dequantization): exact or 1e-6.

Attention is not this file's subject. The backend tests run once with `OracleAttention`, a
TEST-ONLY stand-in that copies the cache to the host and runs ops.paged_attention (it
synchronises, so it cannot be captured in a graph), and once with nanoqwen.cuda.attention's
PagedAttention when that module exists; the graph test needs the latter.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from nanoqwen.cuda import build
from nanoqwen.reference import ops
from nanoqwen.config import PAGE_SIZE, ModelConfig
from nanoqwen.quant import dequantize_int4, tile_int4
from nanoqwen.random_model import QWEN25_CODER_7B
from nanoqwen.sampling import SamplingParams, gumbel_noise, most_likely_first, nucleus, sample

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

# noqa: E402 below: these need cupy only when used, but the skip comes first
from nanoqwen.cuda.abi import ARGMAX_THREADS, GATE_UP_MAX_SPLITS, GEMV_MAX_SPLITS, LM_HEAD_THREADS, RMS_CLUSTER  # noqa: E402
from nanoqwen.cuda.abi import STATUS_HOST_DRAWS, TOP_K_MAX  # noqa: E402
from nanoqwen.cuda.backend import CudaBackend  # noqa: E402
from nanoqwen.cuda.device import NULL, fit_gemv_rings, mapped_host_array, persistent_blocks, set_carveout, sm_budget  # noqa: E402
from nanoqwen.cuda.plan import (  # noqa: E402
    GEMV_CARVEOUT_PERCENT, GEMV_KERNELS, GEMV_STAGES_MACROS, QKV_ROPE_KERNEL, block_threads, chain_block_shared_bytes,
    chain_gemv_registers, gate_up_block_shared_bytes, gate_up_registers, gemv_launch, planned_ring_bytes,
    projection_splits, resident_blocks,
)
from nanoqwen.cuda.sampler import sampler_settings  # noqa: E402

ODD = ModelConfig(
    num_layers=2, hidden_size=384, intermediate_size=640, num_heads=6, num_kv_heads=2, head_dim=64,
    vocab_size=1003, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# The 14B's and 32B's width: rows of 5120 halves, which lm_head reads at two blocks per SM.
WIDE = dataclasses.replace(ODD, hidden_size=5120, intermediate_size=1024, num_heads=40, num_kv_heads=8, head_dim=128)
CONFIGS = {"7b": QWEN25_CODER_7B, "odd": ODD, "wide": WIDE}
DOT_RTOL = 2e-5
SAMPLED_ROWS = 384  # rows checked against the float64 reference in the large matrices


@functools.lru_cache(maxsize=None)
def module(config_name: str):
    return build.compile_module(CONFIGS[config_name])


def kernel(config_name: str, name: str):
    return module(config_name).get_function(name)


def num_sms() -> int:
    return cp.cuda.Device().attributes["MultiProcessorCount"]


def poisoned(shape, dtype):
    return cp.full(shape, cp.nan, dtype=dtype)


def assert_half_close(actual: np.ndarray, expected: np.ndarray, extra=0.0) -> None:
    """|actual - expected| <= one fp16 spacing at expected, plus `extra` (scalar or array)."""
    actual = np.asarray(actual, dtype=np.float32)
    expected32 = np.asarray(expected, dtype=np.float32)
    assert np.isfinite(actual).all(), f"{(~np.isfinite(actual)).sum()} elements not written or not finite"
    spacing = np.spacing(np.abs(expected32).astype(np.float16)).astype(np.float32)
    error = np.abs(actual - expected32)
    bad = error > spacing + extra
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} fp16 results off by more than one spacing; "
        f"worst {error.max():.3g} at {np.unravel_index(error.argmax(), error.shape)}"
    )


def int4_reference(qweight, scales, bias, x, rows):
    """Exact (float64) y[rows] of the INT4 linear, and the bound sum_k |x_k w_k| per row."""
    w = dequantize_int4(qweight[rows], scales[rows]).astype(np.float64)
    x64 = x.astype(np.float64)
    y = w @ x64
    if bias is not None:
        y += bias[rows].astype(np.float64)
    return y, np.abs(w) @ np.abs(x64)


def random_int4(rng, out_features: int, in_features: int):
    """Packed words with every nibble value 0..15 (the kernel must handle q = -8 too), and
    scales of the size real weights have."""
    qweight = rng.integers(0, 2**32, size=(out_features, in_features // 8), dtype=np.uint32)
    scales = (0.004 + 0.008 * rng.random((out_features, in_features // 128))).astype(np.float16)
    return qweight, scales


def device_tiled(qweight, scales):
    """(words, scales) on the device in the GEMVs' layout, as the backend uploads them: the
    words tiled (quant.tile_int4), the scales row-major."""
    return cp.asarray(tile_int4(qweight)), cp.asarray(scales)


def checked_rows(rng, n: int) -> np.ndarray:
    if n <= 2 * SAMPLED_ROWS:
        return np.arange(n)
    return np.unique(np.concatenate([[0, n - 1], rng.choice(n, SAMPLED_ROWS, replace=False)]))


# ---------------------------------------------------------------------- add_rmsnorm


@pytest.mark.parametrize("config_name", ["7b", "odd"])
@pytest.mark.parametrize("rows, with_delta", [(1, False), (1, True), (5, True), (3, True)])
@pytest.mark.parametrize("name", ["add_rmsnorm", "add_rmsnorm_cluster"])
def test_add_rmsnorm(config_name, rows, with_delta, name):
    """One block per row, and decode's form: each row over a cluster of RMS_CLUSTER blocks;
    without a delta (layer 0 normalises the embedding as it is)."""
    c = CONFIGS[config_name]
    rng = np.random.default_rng([rows, with_delta, c.hidden_size])
    h = c.hidden_size
    residual = 2 * rng.standard_normal((rows, h), dtype=np.float32)
    delta = rng.standard_normal((rows, h), dtype=np.float32) if with_delta else np.zeros((rows, h), np.float32)
    weight = (1 + 0.1 * rng.standard_normal(h)).astype(np.float16)
    residual_dev = cp.asarray(residual)
    out = poisoned((rows, h), cp.float16)
    blocks = rows * (RMS_CLUSTER if name == "add_rmsnorm_cluster" else 1)
    kernel(config_name, name)(
        (blocks,), (block_threads(c)[name],),
        (residual_dev, cp.asarray(delta) if with_delta else NULL, cp.asarray(weight), out),
    )
    expected_residual, expected = ops.add_rmsnorm(residual, delta, weight, c.rms_norm_eps)
    np.testing.assert_allclose(residual_dev.get(), expected_residual, rtol=1e-6, atol=1e-5)
    assert_half_close(out.get(), expected)


# ---------------------------------------------------------------------- embedding


@pytest.mark.parametrize("config_name", ["7b", "odd"])
def test_embed_tokens(config_name):
    c = CONFIGS[config_name]
    rng = np.random.default_rng(7)
    table = rng.standard_normal((c.vocab_size, c.hidden_size), dtype=np.float32).astype(np.float16)
    ids = np.concatenate([[0, c.vocab_size - 1], rng.integers(0, c.vocab_size, 5)]).astype(np.int32)
    out = poisoned((len(ids), c.hidden_size), cp.float32)
    kernel(config_name, "embed_tokens")((len(ids),), (block_threads(c)["embed_tokens"],),
                                        (cp.asarray(ids), cp.asarray(table), out))
    np.testing.assert_array_equal(out.get(), ops.embed(ids, table))


# ---------------------------------------------------------------------- INT4 GEMV

GEMV_CASES = [  # config, kernel, what, rows (N), bias
    ("7b", "gemv_int4_from_hidden", "q|k|v fused", 4608, True),
    ("7b", "gemv_int4_from_hidden", "q", 3584, True),
    ("7b", "gemv_int4_from_hidden", "k", 512, True),
    ("7b", "gemv_int4_from_q_dim", "o", 3584, False),
    ("7b", "gemv_int4_from_intermediate", "down", 3584, False),
    ("odd", "gemv_int4_from_hidden", "q|k|v fused", 640, True),
    ("odd", "gemv_int4_from_hidden", "rows not a multiple of 16", 1000, True),
    ("odd", "gemv_int4_from_q_dim", "o", 384, False),
    ("odd", "gemv_int4_from_intermediate", "down, rows not a multiple of 16", 390, False),
]
IN_FEATURES = {"gemv_int4_from_hidden": "hidden_size", "gemv_int4_from_q_dim": "q_dim",
               "gemv_int4_from_intermediate": "intermediate_size"}
PROJECTION_OF = {kernel: projection for projection, kernel in GEMV_KERNELS.items()}


@pytest.mark.parametrize("config_name", ["7b", "odd"])
def test_planned_ring_bytes_match_the_device(config_name):
    """Chapter 6's dry run plans the GEMVs' shared memory from the kernel file's default depths
    (build.macro_defaults, plan.planned_ring_bytes); the device reports its own."""
    stages = build.macro_defaults("gemv_int4.cu")
    for name, macro in GEMV_STAGES_MACROS.items():
        planned = planned_ring_bytes(name, int(stages[macro]), CONFIGS[config_name].group_size)
        assert planned == build.module_int(module(config_name), f"{name}_ring_bytes"), name


@pytest.mark.parametrize("config_name", ["7b", "odd"])
def test_the_device_holds_the_chain_gemvs_blocks_the_plan_counts(config_name):
    """plan.chain_splits picks q|k|v's and o's split from resident_blocks without a GPU: the compiled
    kernels stay within its register bound, and at every split the driver fits at least as many
    of their blocks per SM as the plan counts."""
    sm = sm_budget(cp.cuda.Device())
    group_size = CONFIGS[config_name].group_size
    for name in ("gemv_int4_from_hidden", QKV_ROPE_KERNEL, "gemv_int4_from_q_dim"):
        function = kernel(config_name, name)
        assert function.attributes["num_regs"] <= chain_gemv_registers(sm), name
        set_carveout(function, GEMV_CARVEOUT_PERCENT[name])
        ring_bytes = fit_gemv_rings(function, module(config_name), name)
        for splits in range(1, GEMV_MAX_SPLITS + 1):
            planned = resident_blocks(splits, chain_gemv_registers(sm), chain_block_shared_bytes(splits, group_size), sm)
            driver = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.kernel.ptr, splits * 32,
                                                                             splits * ring_bytes)
            assert driver >= planned, (name, splits, driver, planned)


@pytest.mark.parametrize("config_name", ["7b", "odd"])
def test_the_device_holds_the_gate_up_blocks_the_plan_counts(config_name):
    """plan.gate_up_splits counts gate+up's blocks per SM without a GPU: the compiled kernel stays
    within its register bound, its static shared memory is the plan's less the rings, and at every
    split the driver fits at least as many of its blocks per SM as the plan counts."""
    sm, c = sm_budget(cp.cuda.Device()), CONFIGS[config_name]
    name = "gemv_int4_gate_up_silu"
    function = kernel(config_name, name)
    assert function.attributes["num_regs"] <= gate_up_registers(sm)
    set_carveout(function, GEMV_CARVEOUT_PERCENT[name])
    ring_bytes = fit_gemv_rings(function, module(config_name), name)
    for splits in range(1, GATE_UP_MAX_SPLITS + 1):
        shared = gate_up_block_shared_bytes(splits, c.hidden_size, c.group_size)
        assert function.attributes["shared_size_bytes"] + splits * ring_bytes == shared, splits
        planned = resident_blocks(splits, gate_up_registers(sm), shared, sm)
        driver = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.kernel.ptr, splits * 32,
                                                                         splits * ring_bytes)
        assert driver >= planned, (splits, driver, planned)


@pytest.mark.parametrize("split_choice", ["one", "backend", "a block's most"])
@pytest.mark.parametrize("case", GEMV_CASES, ids=[f"{c[0]}-{c[2]}" for c in GEMV_CASES])
def test_gemv_int4_split_k(case, split_choice):
    """Every split count the block allows, down to one group per warp (the odd shapes' 3)."""
    config_name, name, _, n, has_bias = case
    c = CONFIGS[config_name]
    k = getattr(c, IN_FEATURES[name])
    rng = np.random.default_rng([n, k, len(split_choice)])
    qweight, scales = random_int4(rng, n, k)
    bias = rng.standard_normal(n, dtype=np.float32).astype(np.float16) * np.float16(0.1) if has_bias else None
    x = rng.standard_normal(k, dtype=np.float32).astype(np.float16)
    splits = {"one": 1, "backend": projection_splits(PROJECTION_OF[name], n, k, num_sms()),
              "a block's most": min(k // 128, GEMV_MAX_SPLITS)}[split_choice]
    out = poisoned(n, cp.float32)
    function = kernel(config_name, name)
    ring_bytes = fit_gemv_rings(function, module(config_name), name)
    grid, block, shared_mem = gemv_launch(name, n, splits, ring_bytes)
    function(grid, block, (*device_tiled(qweight, scales), NULL if bias is None else cp.asarray(bias), cp.asarray(x),
                           out, np.int32(n)), shared_mem=shared_mem)
    y = out.get().astype(np.float64)
    assert np.isfinite(y).all(), f"{(~np.isfinite(y)).sum()} outputs not written"
    rows = checked_rows(rng, n)
    expected, bound = int4_reference(qweight, scales, bias, x, rows)
    error = np.abs(y[rows] - expected)
    assert (error <= DOT_RTOL * bound + 1e-6).all(), f"worst error {error.max():.3g}, bound {bound.max():.3g}"


@pytest.mark.parametrize("config_name", ["7b", "odd"])
@pytest.mark.parametrize("splits", range(1, GATE_UP_MAX_SPLITS + 1))
def test_gemv_int4_gate_up_silu(config_name, splits):
    c = CONFIGS[config_name]
    i, h = c.intermediate_size, c.hidden_size
    rng = np.random.default_rng([11, splits])
    qweight, scales = random_int4(rng, 2 * i, h)
    x = rng.standard_normal(h, dtype=np.float32).astype(np.float16)
    out = poisoned(i, cp.float16)
    function = kernel(config_name, "gemv_int4_gate_up_silu")
    ring_bytes = fit_gemv_rings(function, module(config_name), "gemv_int4_gate_up_silu")
    grid, block, shared_mem = gemv_launch("gemv_int4_gate_up_silu", i, splits, ring_bytes)
    function(grid, block, (*device_tiled(qweight, scales), cp.asarray(x), out), shared_mem=shared_mem)
    rows = checked_rows(rng, i)
    gate, gate_bound = int4_reference(qweight, scales, None, x, rows)
    up, up_bound = int4_reference(qweight, scales, None, x, rows + i)
    expected = gate / (1 + np.exp(-gate)) * up
    # the dot products' own error, carried through silu(g) * u (|silu'| < 1.1, |silu(g)| <= |g|)
    carried = DOT_RTOL * (1.1 * gate_bound * np.abs(up) + np.abs(gate) * up_bound)
    result = out.get()
    assert np.isfinite(result.astype(np.float32)).all(), "some outputs not written"
    assert_half_close(result[rows], expected, extra=carried)


@pytest.mark.parametrize("config_name, n, k", [("7b", 512, 3584), ("odd", 640, 384), ("odd", 384, 640),
                                               ("odd", 1000, 384)])
def test_dequantize_int4_to_half(config_name, n, k):
    """From the tiled layout, with a padded last tile (1000 rows), back to row-major fp16."""
    rng = np.random.default_rng([n, k])
    qweight, scales = random_int4(rng, n, k)
    out = poisoned((n, k), cp.float16)
    kernel(config_name, "dequantize_int4_to_half")(
        (13,), (256,), (*device_tiled(qweight, scales), out, np.int32(n), np.int32(k))
    )
    np.testing.assert_array_equal(out.get(), dequantize_int4(qweight, scales).astype(np.float16))


# ---------------------------------------------------------------------- RoPE + KV write


@pytest.mark.parametrize("config_name", ["7b", "odd"])
@pytest.mark.parametrize("start, count", [(13, 7), (37, 1), (-3, 3)])
def test_rope_write_kv(config_name, start, count):
    """Positions inside partly filled tail pages, across a page boundary, and near the end of
    the context (start < 0 counts back from max_position_embeddings)."""
    c = CONFIGS[config_name]
    if start < 0:
        start += c.max_position_embeddings
    rng = np.random.default_rng([start, count])
    qkv_dim = c.q_dim + 2 * c.kv_dim
    num_pages = 8
    positions = np.arange(start, start + count)
    page_table = rng.integers(0, num_pages, size=positions[-1] // PAGE_SIZE + 1).astype(np.int32)
    touched = np.unique(positions // PAGE_SIZE)
    page_table[touched] = rng.choice(num_pages, len(touched), replace=False)
    qkv = rng.standard_normal((count, qkv_dim), dtype=np.float32)

    kv_layer = poisoned((num_pages, 2, c.num_kv_heads, PAGE_SIZE, c.head_dim), cp.float16)
    q_out = poisoned((count, c.q_dim), cp.float32)
    kernel(config_name, "rope_write_kv")(
        (count, c.num_heads + c.num_kv_heads), (block_threads(c)["rope_write_kv"],),
        (cp.asarray(qkv), cp.asarray([start], dtype=cp.int32),
         cp.asarray(ops.rope_inv_freq(c.head_dim, c.rope_theta)), cp.asarray(page_table), kv_layer, q_out),
    )
    q = qkv[:, : c.q_dim].reshape(count, c.num_heads, c.head_dim)
    k = qkv[:, c.q_dim : c.q_dim + c.kv_dim].reshape(count, c.num_kv_heads, c.head_dim)
    v = qkv[:, c.q_dim + c.kv_dim :].reshape(count, c.num_kv_heads, c.head_dim)
    expected_q = ops.apply_rope(q, positions, c.rope_theta).reshape(count, c.q_dim)
    np.testing.assert_allclose(q_out.get(), expected_q, rtol=1e-5, atol=1e-5 * np.abs(expected_q).max())

    expected_kv = np.full((1, *kv_layer.shape), np.nan, dtype=np.float16)
    ops.write_kv(expected_kv, 0, ops.apply_rope(k, positions, c.rope_theta), v, positions, page_table)
    result = kv_layer.get()
    written = ~np.isnan(expected_kv[0])
    np.testing.assert_array_equal(~np.isnan(result), written, err_msg="K/V written outside the token's slots")
    assert_half_close(result[written], expected_kv[0][written])


@pytest.mark.parametrize("config_name", ["7b", "odd"])
@pytest.mark.parametrize("position, split_choice", [(13, "backend"), (16, "one"), (4090, "a block's most")])
def test_gemv_int4_qkv_rope_writes_what_the_two_kernels_write(config_name, position, split_choice):
    """Decode's fused q|k|v + RoPE + cache write against the plain GEMV followed by rope_write_kv,
    bit for bit, and both against the float64 oracle: inside a tail page, on a page's first row,
    and near the end of the context."""
    c = CONFIGS[config_name]
    h, n = c.hidden_size, c.q_dim + 2 * c.kv_dim
    rng = np.random.default_rng([position, n, len(split_choice)])
    qweight, scales = random_int4(rng, n, h)
    bias = rng.standard_normal(n, dtype=np.float32).astype(np.float16) * np.float16(0.1)
    x = rng.standard_normal(h, dtype=np.float32).astype(np.float16)
    num_pages = 8
    page_table = rng.integers(0, num_pages, size=position // PAGE_SIZE + 1).astype(np.int32)
    splits = {"one": 1, "backend": projection_splits("qkv", n, h, num_sms()),
              "a block's most": min(h // 128, GEMV_MAX_SPLITS)}[split_choice]
    weights = (*device_tiled(qweight, scales), cp.asarray(bias))
    step = (cp.asarray([position], dtype=cp.int32), cp.asarray(ops.rope_inv_freq(c.head_dim, c.rope_theta)),
            cp.asarray(page_table))

    def launch_gemv(name, arguments):
        function = kernel(config_name, name)
        grid, block, shared_mem = gemv_launch(name, n, splits, fit_gemv_rings(function, module(config_name), name))
        function(grid, block, arguments, shared_mem=shared_mem)

    fused_kv = poisoned((num_pages, 2, c.num_kv_heads, PAGE_SIZE, c.head_dim), cp.float16)
    fused_q = poisoned(c.q_dim, cp.float32)
    launch_gemv(QKV_ROPE_KERNEL, (*weights, cp.asarray(x), *step, fused_kv, fused_q))
    qkv = poisoned(n, cp.float32)
    launch_gemv("gemv_int4_from_hidden", (*weights, cp.asarray(x), qkv, np.int32(n)))
    kv, q = poisoned(fused_kv.shape, cp.float16), poisoned(c.q_dim, cp.float32)
    kernel(config_name, "rope_write_kv")((1, c.num_heads + c.num_kv_heads), (block_threads(c)["rope_write_kv"],),
                                         (qkv, step[0], step[1], step[2], kv, q))
    np.testing.assert_array_equal(fused_q.get().view(np.uint32), q.get().view(np.uint32))
    np.testing.assert_array_equal(fused_kv.get().view(np.uint16), kv.get().view(np.uint16))  # NaN where unwritten

    expected, bound = int4_reference(qweight, scales, bias, x, np.arange(n))
    # A rotated value mixes a row with its partner half a head away: it carries both rows' bounds.
    halves = bound.reshape(-1, 2, c.head_dim // 2)
    bound = (halves + halves[:, ::-1]).reshape(-1)
    positions = np.array([position])

    def heads(values, first, count):  # [1 token, count heads, head_dim]
        return values[first : first + count * c.head_dim].reshape(1, count, c.head_dim)

    expected_q = ops.apply_rope(heads(expected, 0, c.num_heads), positions, c.rope_theta).reshape(-1)
    error = np.abs(fused_q.get() - expected_q)
    assert (error <= DOT_RTOL * bound[: c.q_dim] + 1e-6).all(), f"q: worst error {error.max():.3g}"
    expected_kv = np.full((1, *fused_kv.shape), np.nan, dtype=np.float16)
    kv_bound = np.zeros(expected_kv.shape, dtype=np.float32)
    for pool, values in ((expected_kv, expected), (kv_bound, bound)):
        k = heads(values, c.q_dim, c.num_kv_heads)
        if pool is expected_kv:
            k = ops.apply_rope(k, positions, c.rope_theta)
        ops.write_kv(pool, 0, k, heads(values, c.q_dim + c.kv_dim, c.num_kv_heads), positions, page_table)
    result = fused_kv.get()
    written = ~np.isnan(expected_kv[0])
    np.testing.assert_array_equal(~np.isnan(result), written, err_msg="K/V written outside the token's slots")
    assert_half_close(result[written], expected_kv[0][written], extra=DOT_RTOL * kv_bound[0][written])


@pytest.mark.parametrize("config_name", ["7b", "odd"])
def test_silu_mul_rows(config_name):
    c = CONFIGS[config_name]
    rng = np.random.default_rng(5)
    rows = 3
    gate_up = 3 * rng.standard_normal((rows, 2 * c.intermediate_size), dtype=np.float32)
    out = poisoned((rows, c.intermediate_size), cp.float16)
    kernel(config_name, "silu_mul_rows")((7,), (256,), (cp.asarray(gate_up), out, np.int32(rows)))
    expected = ops.silu_mul(gate_up[:, : c.intermediate_size], gate_up[:, c.intermediate_size :])
    assert_half_close(out.get(), expected)


# ---------------------------------------------------------------------- lm_head + argmax


@pytest.mark.parametrize("config_name", ["7b", "odd", "wide"])
@pytest.mark.parametrize("grid", ["persistent", "7 blocks"])
def test_lm_head_and_greedy_argmax(config_name, grid):
    c = CONFIGS[config_name]
    v, h = c.vocab_size, c.hidden_size
    rng = np.random.default_rng([v, len(grid)])
    weight = (0.02 * cp.random.standard_normal((v, h), dtype=cp.float32)).astype(cp.float16)
    x = rng.standard_normal(h, dtype=np.float32).astype(np.float16)
    # Plant a clear winner, and an identical row at a smaller id: the tie must go to it.
    winner, twin = int(rng.integers(v // 2, v)), int(rng.integers(0, v // 2))
    weight[winner] = cp.asarray((0.05 * x).astype(np.float16))
    weight[twin] = weight[winner]
    lm_head = kernel(config_name, "lm_head_logits")
    blocks = persistent_blocks(lm_head, LM_HEAD_THREADS, num_sms()) if grid == "persistent" else 7
    logits = poisoned(v, cp.float32)
    values, indices = poisoned(blocks, cp.float32), cp.full(blocks, -1, dtype=cp.int32)
    lm_head((blocks,), (LM_HEAD_THREADS,), (cp.asarray(x), weight, logits, values, indices, NULL, NULL))
    state = cp.asarray([123, 40, 41, 9, 5, 6, 7], dtype=cp.int32)  # token, position, seq_len, status, pages
    slots, memory = mapped_host_array((16, 4), np.int32)  # host rows for the heads: position 40 goes to row 8
    slots[:] = -7
    kernel(config_name, "argmax_select_next")((1,), (ARGMAX_THREADS,), (values, indices, np.int32(blocks), state,
                                                                        np.uint64(slots.ctypes.data), np.int32(16),
                                                                        logits, NULL, NULL))
    cp.cuda.get_current_stream().synchronize()

    result = logits.get()
    assert np.isfinite(result).all(), f"{(~np.isfinite(result)).sum()} logits not written"
    rows = checked_rows(rng, v)
    w = weight[cp.asarray(rows)].get().astype(np.float64)
    expected, bound = w @ x.astype(np.float64), np.abs(w) @ np.abs(x.astype(np.float64))
    assert (np.abs(result[rows] - expected) <= DOT_RTOL * bound + 1e-6).all()
    assert result[twin] == result[winner]
    np.testing.assert_array_equal(state.get(), [twin, 41, 42, 0, 5, 6, 7])
    np.testing.assert_array_equal(slots[8], [twin, 41, 42, 0])  # the host sees the new head, unasked
    assert (np.delete(slots, 8, axis=0) == -7).all()  # in that row alone
    assert int(np.argmax(result)) == twin


@pytest.mark.parametrize("config_name", ["7b", "odd"])
@pytest.mark.parametrize("temperature", [1e-30, 0.4, 1.0, 8.0])
def test_lm_head_samples_the_tokens_numpy_samples(config_name, temperature):
    """The device's Gumbel-max draw against nanoqwen.sampling.sample on the device's own logits:
    the same noise from the same (seed, position, id), the same float32 keys, the same token. At
    temperature 8 the noise decides most draws, so they check the hash bit for bit; 1e-30 must be
    the argmax."""
    c = CONFIGS[config_name]
    v, h = c.vocab_size, c.hidden_size
    rng = np.random.default_rng([v, int(temperature * 1000)])
    weight = (0.02 * cp.random.standard_normal((v, h), dtype=cp.float32)).astype(cp.float16)
    lm_head, select = kernel(config_name, "lm_head_logits"), kernel(config_name, "argmax_select_next")
    blocks = persistent_blocks(lm_head, LM_HEAD_THREADS, num_sms())
    logits = poisoned(v, cp.float32)
    values, indices = poisoned(blocks, cp.float32), cp.full(blocks, -1, dtype=cp.int32)
    drawn = []
    for trial in range(12):
        x = rng.standard_normal(h, dtype=np.float32).astype(np.float16)
        params = SamplingParams(temperature=temperature, seed=int(rng.integers(0, 2**63)))
        position = int(rng.integers(0, 40_000))
        state = cp.asarray([7, position, position + 1, 0, 0], dtype=cp.int32)
        sampler = cp.asarray(sampler_settings(params, v))
        lm_head((blocks,), (LM_HEAD_THREADS,), (cp.asarray(x), weight, logits, values, indices, state, sampler))
        select((1,), (ARGMAX_THREADS,), (values, indices, np.int32(blocks), state, NULL, np.int32(1), logits, sampler, NULL))
        token, result = int(state[0].get()), logits.get()
        want = sample(result, params, position)
        assert int(state[3].get()) == 0 and int(state[1].get()) == position + 1
        if token != want:  # only a tie of float32 keys may part them, at the host's float64 log's last bit
            keys = (result.astype(np.float64)[[token, want]]
                    + temperature * gumbel_noise(params.key, position, [token, want])).astype(np.float32)
            assert abs(keys[0] - keys[1]) <= np.spacing(np.abs(keys).max()), f"trial {trial}: device chose {token}, numpy {want}"
        drawn.append(token == int(np.argmax(result)))
    if temperature == 1e-30:
        assert all(drawn)
    if temperature == 8.0:
        assert sum(drawn) <= 3  # the noise, not the logits, decides a near-uniform draw


def nucleus_on_an_edge(logits: np.ndarray, params: SamplingParams) -> bool:
    """Whether the nucleus cut of `params` over `logits` moves when its target moves by 1e-12:
    then the device's float64 sum in another order may rightly cut elsewhere."""
    scaled = (logits.astype(np.float64) - logits.max()) / params.temperature
    kept = most_likely_first(scaled, None, params.top_k or len(logits))[: params.top_k or len(logits)]
    mass = np.cumsum(np.exp(scaled[kept]))
    return len({int(np.searchsorted(mass, params.top_p * mass[-1] * (1 + e))) for e in (-1e-12, 0, 1e-12)}) > 1


def nucleus_length(logits: np.ndarray, params: SamplingParams) -> int:
    """How many tokens the host's top-p alone keeps (nanoqwen.sampling.nucleus)."""
    scaled = (logits.astype(np.float64) - logits.max()) / params.temperature
    return len(nucleus(scaled, None, params.top_p))


@pytest.mark.parametrize("config_name", ["7b", "odd"])
@pytest.mark.parametrize("logit_kind", ["normal", "ties", "signed zeros"])
def test_top_k_and_top_p_on_the_device_draw_what_numpy_draws(config_name, logit_kind):
    """argmax_select_next's filtered draw against nanoqwen.sampling.sample on the same logits, for
    top-k from 1 to TOP_K_MAX with and without top-p, and top-p alone (top_k 0 below), which the
    device draws when the run ends among the TOP_K_MAX most likely and otherwise hands to the host
    (status STATUS_HOST_DRAWS). "ties": a few distinct values, so the k-th largest is tied with
    many others and the lowest ids among them must be kept; "signed zeros": -0.0 and +0.0 at the
    boundary, which numpy counts as equal."""
    c = CONFIGS[config_name]
    v = c.vocab_size
    rng = np.random.default_rng([v, len(logit_kind)])
    select = kernel(config_name, "argmax_select_next")
    outcomes = set()
    for top_k, top_p, temperature in [(1, 1.0, 0.7), (2, 1.0, 1.0), (40, 1.0, 0.7), (40, 0.95, 0.7), (40, 0.5, 2.0),
                                      (256, 0.9, 1.0), (300, 0.3, 1.0), (v - 1, 0.9, 1.0), (1000, 0.99, 1.5),
                                      (TOP_K_MAX, 1.0, 1.0), (TOP_K_MAX, 0.05, 0.8),
                                      (0, 0.3, 0.5), (0, 0.9, 0.7), (0, 0.999, 1.5)]:
        if top_k >= v or top_k > TOP_K_MAX or (top_k == 0 and top_p == 1):  # the host's, or lm_head's noise
            continue
        for trial in range(3):
            if logit_kind == "normal":
                logits = (rng.standard_normal(v) * 3).astype(np.float32)
            elif logit_kind == "ties":
                logits = (rng.integers(-12, 1, v) / 4).astype(np.float32)
            else:
                logits = rng.choice(np.array([-1.0, -0.0, 0.0, -2.0], np.float32), v, p=[0.55, 0.05, 0.05, 0.35])
                logits[rng.integers(0, v, 3)] = 1.0
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=int(rng.integers(0, 2**63)))
            position = int(rng.integers(0, 30_000))
            best = int(np.argmax(logits))
            values, indices = cp.asarray([logits[best]], dtype=cp.float32), cp.asarray([best], dtype=cp.int32)
            state = cp.asarray([7, position, position + 1, 0, 0], dtype=cp.int32)
            handed_back = poisoned(3 * v, cp.float32).reshape(3, v)  # three slots: row position % 3
            select((1,), (ARGMAX_THREADS,), (values, indices, np.int32(1), state, NULL, np.int32(3), cp.asarray(logits),
                                             cp.asarray(sampler_settings(params, v)), handed_back))
            token, status, want = int(state[0].get()), int(state[3].get()), sample(logits, params, position)
            assert int(state[1].get()) == position + 1
            case = f"k={top_k} p={top_p} T={temperature} trial {trial}"
            copies = handed_back.get()
            slot = position % 3 if status == STATUS_HOST_DRAWS else None
            assert all(np.isnan(copies[row]).all() for row in range(3) if row != slot), f"{case}: a stray copy"
            if status == STATUS_HOST_DRAWS:
                np.testing.assert_array_equal(copies[slot], logits, err_msg=f"{case}: the logits handed to the host")
                assert top_k == 0 and v > TOP_K_MAX, f"{case}: only a top-p alone over more than TOP_K_MAX tokens hands back"
                assert nucleus_length(logits, params) > TOP_K_MAX or nucleus_on_an_edge(logits, params), \
                    f"{case}: handed to the host a run of {nucleus_length(logits, params)} tokens"
            else:
                assert status == 0, f"{case}: status {status}"
                if top_k == 0 and v > TOP_K_MAX:
                    assert nucleus_length(logits, params) <= TOP_K_MAX or nucleus_on_an_edge(logits, params)
                if token != want:
                    assert top_p < 1 and nucleus_on_an_edge(logits, params), f"{case}: device chose {token}, numpy {want}"
            outcomes.add((top_k == 0, status))
    if config_name == "7b" and logit_kind == "normal":  # both outcomes of a top-p alone were seen
        assert {(True, 0), (True, STATUS_HOST_DRAWS)} <= outcomes, outcomes


@pytest.mark.parametrize("poison", ["nan", "inf", "-inf everywhere"])
def test_greedy_argmax_flags_non_finite_logits(poison):
    """numpy's greedy choice raises on NaN, +inf or all -inf logits (nanoqwen/sampling.py); the
    device's writes status 1 instead, for the host to raise. One poisoned row among many."""
    c = CONFIGS["odd"]
    v, h = c.vocab_size, c.hidden_size
    rng = np.random.default_rng(len(poison))
    weight = (0.02 * cp.random.standard_normal((v, h), dtype=cp.float32)).astype(cp.float16)
    x = rng.standard_normal(h, dtype=np.float32).astype(np.float16)
    bad_row = int(rng.integers(0, v))
    if poison == "nan":
        weight[bad_row, 5] = np.float16(np.nan)
    elif poison == "inf":  # finite fp16 inputs cannot overflow an fp32 sum: an infinite weight row
        weight[bad_row] = np.float16(np.inf)
        x = (np.abs(x) + np.float16(0.5)).astype(np.float16)  # all positive: +inf, not inf - inf
    else:
        weight[:] = np.float16(0)
        x[:] = np.float16(0)
    lm_head = kernel("odd", "lm_head_logits")
    blocks = persistent_blocks(lm_head, LM_HEAD_THREADS, num_sms())
    logits = poisoned(v, cp.float32)
    values, indices = poisoned(blocks, cp.float32), cp.full(blocks, -1, dtype=cp.int32)
    lm_head((blocks,), (LM_HEAD_THREADS,), (cp.asarray(x), weight, logits, values, indices, NULL, NULL))
    if poison == "-inf everywhere":  # no weights give -inf logits: feed the reduction directly
        values[:] = -np.inf
    state = cp.asarray([1, 2, 3, 0, 4], dtype=cp.int32)
    kernel("odd", "argmax_select_next")((1,), (ARGMAX_THREADS,), (values, indices, np.int32(blocks), state, NULL, np.int32(1),
                                        logits, NULL, NULL))
    assert int(state[3].get()) == 1, f"{poison}: status not raised"


# ---------------------------------------------------------------------- the backend


class OracleAttention:
    """TEST-ONLY stand-in for nanoqwen.cuda.attention.PagedAttention: copies q and the layer's
    cache to the host and runs ops.paged_attention. It synchronises with the host, so a
    decode step that uses it cannot be captured in a CUDA graph; it allocates no device memory."""

    launches_per_decode = 0

    def __init__(self, config: ModelConfig, num_pages: int, max_seq_len: int):
        self.config = config

    def _attend(self, q, kv_layer, page_table, positions, out, stream):
        c = self.config
        q = q.get(stream=stream).reshape(len(positions), c.num_heads, c.head_dim)
        result = ops.paged_attention(q, kv_layer.get(stream=stream)[None], 0, page_table.get(stream=stream), positions)
        out.set(result.reshape(out.shape).astype(np.float16), stream=stream)

    def decode(self, q, kv_layer, page_table, seq_len, out, stream=None):
        stream = stream or cp.cuda.get_current_stream()
        position = int(seq_len.get(stream=stream)[0]) - 1
        self._attend(q, kv_layer, page_table, np.array([position]), out, stream)

    def prefill(self, q, kv_layer, page_table, start_pos, num_tokens, out):
        self._attend(q, kv_layer, page_table, np.arange(start_pos, start_pos + num_tokens), out,
                     cp.cuda.get_current_stream())


def _attentions() -> dict:
    found = {"oracle": OracleAttention}
    try:
        from nanoqwen.cuda.attention import PagedAttention
    except ModuleNotFoundError:
        return found
    return {**found, "paged": PagedAttention}


# The backend tests run with each: a failure under "paged" only points at attention's kernels.
ATTENTIONS = _attentions()
TINY_MODELS = {
    "tiny": {},  # nanoqwen.testing.DEFAULT_CONFIG: hidden 128, head_dim 32, GQA 2:1
    "odd": dict(hidden_size=384, intermediate_size=640, num_heads=6, num_kv_heads=2, head_dim=64, vocab_size=1000),
}


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def tiny_model(request, tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import nanoqwen
    from nanoqwen.testing import make_nanoqwen

    path = make_nanoqwen(tmp_path_factory.mktemp(request.param), seed=3, tokenizer=False, **TINY_MODELS[request.param])
    return nanoqwen.load(path)


@pytest.fixture(params=sorted(ATTENTIONS))
def attention(request):
    return ATTENTIONS[request.param]


def make_backends(model, num_pages: int, attention):
    from nanoqwen.reference.backend import NumpyBackend

    # The oracle attention synchronises with the host, so its steps run eagerly, not in a graph.
    gpu = CudaBackend(model, num_pages, attention_factory=attention, use_graph=attention is not OracleAttention)
    gpu.kv_pool.fill(cp.nan)  # attention must read only rows its sequence wrote
    cp.cuda.Device().synchronize()  # the fill ran on the default stream, the backend uses its own
    reference = NumpyBackend(model, num_pages)
    reference.kv_pool[...] = np.nan
    return gpu, reference


def assert_logits_close(actual: np.ndarray, expected: np.ndarray) -> None:
    """Within 1% of the largest logit. The two backends differ only by rounding (prefill also
    by its fp16 weight expansion), which moves logits by ~1e-3 of their scale; an error in a
    kernel or its plumbing moves them by O(1)."""
    assert np.isfinite(actual).all()
    error = np.abs(actual - expected).max()
    assert error <= 1e-2 * np.abs(expected).max(), f"max logit error {error:.3g}"


def test_backend_matches_numpy_backend(tiny_model, attention):
    c = tiny_model.config
    rng = np.random.default_rng(1)
    num_pages = 12
    gpu, reference = make_backends(tiny_model, num_pages, attention)
    page_table = rng.permutation(num_pages)[:6].astype(np.int32)  # 96 positions, pages out of order
    prompt = rng.integers(0, c.vocab_size, 21)
    expected = reference.prefill(prompt, 0, page_table)
    assert_logits_close(gpu.prefill(prompt, 0, page_table), expected)
    token = int(np.argmax(expected))
    for position in range(21, 35):  # fills page 1's tail, crosses into page 2
        logits = gpu.decode(token, position, page_table)
        expected = reference.decode(token, position, page_table)
        assert_logits_close(logits, expected)
        assert int(gpu.token.get()[0]) == int(np.argmax(logits)), "device argmax differs from the logits'"
        token = int(np.argmax(expected))
    # A second prefill that continues the sequence (chunked prompt, multi-turn chat).
    more = rng.integers(0, c.vocab_size, 9)
    assert_logits_close(gpu.prefill(more, 35, page_table), reference.prefill(more, 35, page_table))
    cached, expected_cache = gpu.kv_pool.get(), reference.kv_pool
    np.testing.assert_array_equal(np.isnan(cached), np.isnan(expected_cache), err_msg="cache rows written differ")
    written = ~np.isnan(expected_cache)
    np.testing.assert_allclose(cached[written], expected_cache[written], rtol=2e-2, atol=2e-2)


def test_prefill_from_kept_weights_equals_prefill_from_expanded_ones(tiny_model):
    """prefill_weights="cache" dequantizes every projection once at start; "expand" does it per
    prompt into one scratch buffer. Same kernel, same GEMMs: the logits and K/V must be identical."""
    c = tiny_model.config
    rng = np.random.default_rng(4)
    page_table = rng.permutation(8)[:4].astype(np.int32)
    prompt = rng.integers(0, c.vocab_size, 37)
    results = {}
    for policy in ("cache", "expand"):
        gpu = CudaBackend(tiny_model, 8, prefill_weights=policy)
        assert gpu.prefill_weights == policy
        assert all((lin.dense is not None) == (policy == "cache") for lin in gpu._linears())
        results[policy] = (gpu.prefill(prompt, 0, page_table), gpu.kv_pool.get())
    np.testing.assert_array_equal(results["cache"][0], results["expand"][0])
    np.testing.assert_array_equal(results["cache"][1], results["expand"][1])
    assert CudaBackend(tiny_model, 8).prefill_weights == "cache", "a tiny model always fits: auto keeps the copies"


def test_free_device_bytes_leave_out_a_block_only_one_stream_reuses():
    """A block freed on the default stream and then split there stays in CuPy's pool, usable by that
    stream only; "auto" must not count it as room for the backend's copies. The 32B's copies leave
    about 2 GiB of an 80 GB H100 free, so one such block decides whether its first prefill finds
    room."""
    from nanoqwen.cuda.device import free_device_bytes

    pool = cp.get_default_memory_pool()
    gib = 1 << 30
    before = free_device_bytes()
    block = cp.empty(gib, dtype=cp.uint8)
    del block  # one free GiB in the default stream's arena
    piece = cp.empty(gib // 2, dtype=cp.uint8)  # split from it (no other free block is as large)
    assert pool.free_bytes() >= gib // 2, "the pool keeps the other half, which cannot go back to the driver"
    assert free_device_bytes() < before - gib + 64 * 2**20, "the kept half counted as free"
    del piece
    assert free_device_bytes() > before - 64 * 2**20, "the merged GiB goes back to the driver"


def test_rope_in_the_qkv_gemv_changes_no_bit_of_a_decode_step(tiny_model):
    """Decode's fused q|k|v + RoPE kernel (the fp16 default) against the plain GEMV followed by
    rope_write_kv: the same logits and the same cache, bit for bit, over steps that fill a tail
    page and cross into the next, and one launch fewer per layer."""
    c = tiny_model.config
    rng = np.random.default_rng(6)
    page_table = rng.permutation(8)[:4].astype(np.int32)
    prompt = rng.integers(0, c.vocab_size, 13)
    runs = {}
    for fused in (True, False):
        gpu = CudaBackend(tiny_model, 8)
        assert gpu.rope_in_qkv  # the fp16 default
        gpu.rope_in_qkv = fused
        token, logits = int(np.argmax(gpu.prefill(prompt, 0, page_table))), []
        for position in range(13, 20):
            logits.append(gpu.decode(token, position, page_table))
            token = int(np.argmax(logits[-1]))
        runs[fused] = (np.array(logits), gpu.kv_pool.get(), gpu.launches_per_token)
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    np.testing.assert_array_equal(runs[True][1].view(np.uint16), runs[False][1].view(np.uint16))
    assert runs[False][2] - runs[True][2] == c.num_layers
    assert not CudaBackend(tiny_model, 8, activations="int8").rope_in_qkv, "Path A keeps rope_write_kv"


def test_device_advanced_steps_match_host_driven_steps(tiny_model, attention):
    c = tiny_model.config
    rng = np.random.default_rng(2)
    gpu, _ = make_backends(tiny_model, 8, attention)
    page_table = rng.permutation(8)[:4].astype(np.int32)
    prompt = rng.integers(0, c.vocab_size, 14)
    first = int(np.argmax(gpu.prefill(prompt, 0, page_table)))
    host_driven, token = [], first
    for position in range(14, 20):
        token = gpu.decode_next(token, position, page_table)
        host_driven.append(token)

    gpu.prefill(prompt, 0, page_table)
    gpu.set_step_inputs(first, 14, page_table)
    pool = cp.get_default_memory_pool()
    used = pool.used_bytes()
    device_driven = []
    for _ in range(6):
        assert gpu.decode_step_launches(gpu.stream) == gpu.launches_per_token
        device_driven.append(int(gpu.token.get(stream=gpu.stream)[0]))
    assert pool.used_bytes() == used, "a decode step allocated device memory"
    assert device_driven == host_driven
    np.testing.assert_array_equal(gpu.state[:3].get(), [host_driven[-1], 20, 21])


def test_decode_step_replays_as_a_cuda_graph(tiny_model):
    if "paged" not in ATTENTIONS:
        pytest.skip("nanoqwen.cuda.attention is missing; the test-only oracle attention cannot be captured")
    c = tiny_model.config
    rng = np.random.default_rng(4)
    gpu, _ = make_backends(tiny_model, 8, ATTENTIONS["paged"])
    gpu.use_graph = False  # the reference run launches every kernel eagerly
    page_table = rng.permutation(8)[:4].astype(np.int32)
    prompt = rng.integers(0, c.vocab_size, 9)
    first = int(np.argmax(gpu.prefill(prompt, 0, page_table)))
    eager = [gpu.decode_next(first, 9, page_table)]
    for position in range(10, 14):
        eager.append(gpu.decode_next(eager[-1], position, page_table))

    stream = gpu.stream
    with stream:
        stream.begin_capture()
        gpu.decode_step_launches(stream)
        graph = stream.end_capture()
    gpu.set_step_inputs(first, 9, page_table)
    replayed = []
    for _ in range(5):
        graph.launch(stream)
        replayed.append(int(gpu.token.get(stream=stream)[0]))
    assert replayed == eager


def test_bad_inputs_are_refused(tiny_model):
    gpu, _ = make_backends(tiny_model, 4, OracleAttention)
    page_table = np.arange(4, dtype=np.int32)
    with pytest.raises(ValueError, match="token ids"):
        gpu.decode(tiny_model.config.vocab_size, 0, page_table)
    with pytest.raises(ValueError, match="need 2 pages"):
        gpu.decode(1, 16, page_table[:1])
    with pytest.raises(ValueError, match="ids outside"):
        gpu.prefill(np.array([1, 2]), 0, np.array([0, 9], dtype=np.int32))
    with pytest.raises(ValueError, match="outside 0"):
        gpu.decode(1, 4 * PAGE_SIZE, page_table)
