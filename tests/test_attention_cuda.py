"""Paged attention kernels (kernels/paged_attention.cu) against the numpy oracle.

The planning helpers run everywhere; the kernels need CuPy and a GPU (marked `gpu`, skipped
otherwise). tools/gpu_check_attention.py runs the longer lengths, the broken kernel, the
sanitizers and the timings.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from nanoqwen.reference import ops
from nanoqwen.config import PAGE_SIZE, ModelConfig
from nanoqwen.errors import ConfigError
from nanoqwen.cuda.attention import check_config, decode_splits, random_paged_cache, relative_error, split_pages
from nanoqwen.random_model import QWEN25_CODER_7B


def shape(num_heads: int, num_kv_heads: int, head_dim: int) -> ModelConfig:
    hidden = max(128, -(-num_heads * head_dim // 128) * 128)
    return ModelConfig(num_layers=1, hidden_size=hidden, intermediate_size=256, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=256, max_position_embeddings=4096,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)


# 12-1: more query heads per KV head than 8, so the decode kernel's mma rows 8-15 hold heads too
SHAPES = [QWEN25_CODER_7B, shape(4, 2, 64), shape(4, 2, 32), shape(8, 1, 96), shape(2, 2, 64), shape(12, 1, 64)]
SHAPE_IDS = ["7b-28-4-d128", "4-2-d64", "4-2-d32", "8-1-d96", "mha-2-2-d64", "gqa12-12-1-d64"]


# ---------------------------------------------------------------------------- everywhere


def test_split_pages_cover_the_sequence_once():
    for seq_len in (1, 15, 16, 17, 640, 4097, 32768):
        for splits in (1, 3, 66, 5000):
            ranges = split_pages(seq_len, splits)
            assert len(ranges) <= splits
            pages = [p for first, count in ranges for p in range(first, first + count)]
            assert pages == list(range(-(-seq_len // PAGE_SIZE)))
            assert all(count > 0 for _, count in ranges)
            if len(pages) <= splits:  # a block per page while the pages fit the grid
                assert all(count == 1 for _, count in ranges)
            else:  # else equal runs for half the grid, one block per SM
                assert len(ranges) <= -(-splits // 2)
                assert len({count for _, count in ranges[:-1]}) <= 1


DIVISION_PROGRAM = r"""
#include "paged_attention.cuh"
#include <cstdio>
int main() {
  for (int splits : {1, 2, 3, 17, 33, 66, 132})
    for (int seq_len = 1; seq_len <= 4500; seq_len += 7) {
      const SequenceDivision d = divide_sequence(seq_len, splits);
      std::printf("%d %d %d %d %d\n", seq_len, splits, d.num_pages, d.pages_per_split, d.active_splits);
    }
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_kernels_divide_a_sequence_as_split_pages_does(tmp_path):
    """divide_sequence (kernels/paged_attention.cuh), which the decode, combine and persistent kernels
    divide by, built for the host and run over lengths and grids: split_pages is its host copy."""
    from nanoqwen.cuda import build

    source, program = tmp_path / "division.cu", tmp_path / "division"
    source.write_text(DIVISION_PROGRAM)
    defines = build.define_options(build.kernel_defines(QWEN25_CODER_7B))
    compiled = subprocess.run(["nvcc", "-std=c++17", build.NVCC_ARCH, f"-I{build.kernel_dir()}", *defines,
                               "-o", str(program), str(source)], capture_output=True, text=True, timeout=300)
    assert compiled.returncode == 0, compiled.stderr[-4000:]
    lines = subprocess.run([str(program)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(lines) == 7 * len(range(1, 4501, 7))
    for line in lines:
        seq_len, splits, num_pages, pages_per_split, active_splits = map(int, line.split())
        ranges = split_pages(seq_len, splits)
        assert num_pages == -(-seq_len // PAGE_SIZE)
        assert (pages_per_split, active_splits) == (ranges[0][1], len(ranges)), line


def test_decode_grid_fills_the_gpu_but_never_exceeds_the_pages():
    assert decode_splits(num_kv_heads=4, max_seq_len=32768, num_sms=132) * 4 >= 2 * 132
    assert decode_splits(num_kv_heads=4, max_seq_len=20, num_sms=132) == 2  # two pages at most
    assert decode_splits(num_kv_heads=64, max_seq_len=32768, num_sms=132) >= 1


def test_unsupported_shapes_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="head_dim"):
        check_config(shape(8, 2, 48))
    with pytest.raises(ConfigError, match="head_dim"):
        check_config(shape(2, 1, 256))
    with pytest.raises(ConfigError, match="at most 16 query heads per KV head"):
        check_config(shape(20, 1, 64))
    check_config(shape(16, 1, 64))  # the widest grouping the decode kernel holds
    check_config(shape(4, 4, 64))  # no grouping at all


def test_random_cache_poisons_every_row_the_sequence_does_not_own():
    config = shape(4, 2, 32)
    pool, table = random_paged_cache(config, 17, np.random.default_rng(0))
    assert len(table) == 2 and len(set(table.tolist())) == 2
    k, v = ops.gather_kv(pool, 0, table, 17)
    assert np.isfinite(k).all() and np.isfinite(v).all()
    assert np.isnan(pool[0, table[1], :, :, 1:]).all()  # the tail page past position 16
    spare = np.setdiff1d(np.arange(pool.shape[1]), table)
    assert np.isnan(pool[0, spare]).all()


# ---------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def cp():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError as e:
        pytest.skip(f"no CUDA device: {e}")
    return cupy


def run_decode(cp, attention, config, seq_len, rng):
    pool, table = random_paged_cache(config, seq_len, rng)
    q = (2.0 * rng.standard_normal(config.q_dim)).astype(np.float32)
    table_d = cp.full(-(-attention.max_seq_len // PAGE_SIZE), -1, dtype=cp.int32)
    table_d[: len(table)] = cp.asarray(table)
    out = cp.full(config.q_dim, np.nan, dtype=cp.float16)  # poisoned: every element must be written
    attention.decode(cp.asarray(q), cp.asarray(pool[0]), table_d, cp.asarray(np.array([seq_len], np.int32)), out)
    ref = ops.paged_attention(q.reshape(1, config.num_heads, config.head_dim), pool, 0, table,
                                    np.array([seq_len - 1]))
    return relative_error(out.get(), ref.reshape(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("config", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_the_oracle(cp, config):
    from nanoqwen.cuda.attention import PagedAttention

    rng = np.random.default_rng(1)
    grid_for_long = PagedAttention(config, num_pages=300, max_seq_len=4096)
    one_block = PagedAttention(config, num_pages=300, max_seq_len=4096, splits=1)
    for seq_len in (1, 15, 16, 17, 33, 640, 2049):
        for attention in (grid_for_long, one_block):
            err = run_decode(cp, attention, config, seq_len, rng)
            assert err < 2e-3, (seq_len, attention.splits, err)


@pytest.mark.gpu
@pytest.mark.parametrize("config", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("start_pos,num_tokens", [(0, 1), (0, 17), (0, 200), (37, 5), (500, 64)])
def test_prefill_matches_the_oracle(cp, config, start_pos, num_tokens):
    from nanoqwen.cuda.attention import PagedAttention

    rng = np.random.default_rng(start_pos * 1000 + num_tokens)
    attention = PagedAttention(config, num_pages=300, max_seq_len=4096)
    end = start_pos + num_tokens
    pool, table = random_paged_cache(config, end, rng)
    q = (2.0 * rng.standard_normal((num_tokens, config.q_dim))).astype(np.float32)
    out = cp.full((num_tokens, config.q_dim), np.nan, dtype=cp.float16)
    attention.prefill(cp.asarray(q), cp.asarray(pool[0]), cp.asarray(table), start_pos, num_tokens, out)
    ref = ops.paged_attention(q.reshape(num_tokens, config.num_heads, config.head_dim), pool, 0, table,
                                    start_pos + np.arange(num_tokens))
    assert relative_error(out.get(), ref.reshape(num_tokens, -1)) < 3e-3


@pytest.mark.gpu
def test_one_captured_graph_serves_every_length(cp):
    from nanoqwen.cuda.attention import PagedAttention

    config = QWEN25_CODER_7B
    rng = np.random.default_rng(5)
    attention = PagedAttention(config, num_pages=300, max_seq_len=4096)
    pool, table = random_paged_cache(config, 1000, rng)
    table_d = cp.full(4096 // PAGE_SIZE, -1, dtype=cp.int32)
    table_d[: len(table)] = cp.asarray(table)
    kv, q = cp.asarray(pool[0]), (2.0 * rng.standard_normal(config.q_dim)).astype(np.float32)
    q_d, seq_len, out = cp.asarray(q), cp.zeros(1, cp.int32), cp.empty(config.q_dim, cp.float16)
    cp.cuda.Device().synchronize()  # the inputs were made on the default stream, which ours does not wait for
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        attention.decode(q_d, kv, table_d, seq_len, out, stream=stream)
        graph = stream.end_capture()
        for n in (1, 17, 999, 64):
            seq_len.set(np.array([n], np.int32), stream=stream)
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            ref = ops.paged_attention(q.reshape(1, config.num_heads, config.head_dim), pool, 0, table,
                                            np.array([n - 1]))
            assert relative_error(out.get(), ref.reshape(-1)) < 2e-3, n


@pytest.mark.gpu
def test_bad_arguments_are_refused(cp):
    from nanoqwen.cuda.attention import PagedAttention

    config = shape(4, 2, 32)
    attention = PagedAttention(config, num_pages=8, max_seq_len=128)
    kv = cp.zeros((8, 2, 2, PAGE_SIZE, 32), cp.float16)
    table, seq_len = cp.zeros(8, cp.int32), cp.ones(1, cp.int32)
    with pytest.raises(ValueError, match="q must be"):
        attention.decode(cp.zeros(128, cp.float16), kv, table, seq_len, cp.zeros(128, cp.float16))
    with pytest.raises(ValueError, match="kv_layer"):
        attention.decode(cp.zeros(128, cp.float32), kv[:, :, :1], table, seq_len, cp.zeros(128, cp.float16))
    with pytest.raises(ValueError, match="max_seq_len"):
        attention.prefill(cp.zeros((10, 128), cp.float32), kv, table, 120, 10, cp.zeros((10, 128), cp.float16))
