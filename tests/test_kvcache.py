"""The page allocator and the pool layout of the paged KV cache."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoqwen.reference import ops
from nanoqwen.config import ModelConfig
from nanoqwen.errors import KVCacheFullError
from nanoqwen.kvcache import PAGE_SIZE, PageAllocator, kv_bytes_per_token, kv_pool_shape, pages_needed

QWEN25_CODER_7B = ModelConfig(num_layers=28, hidden_size=3584, intermediate_size=18944, num_heads=28,
                              num_kv_heads=4, head_dim=128, vocab_size=152064, max_position_embeddings=32768,
                              rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def test_pages_needed():
    assert PAGE_SIZE == 16
    assert [pages_needed(n) for n in (0, 1, 15, 16, 17, 45, 48, 49)] == [0, 1, 1, 1, 2, 3, 3, 4]
    with pytest.raises(ValueError):
        pages_needed(-1)


def test_pool_layout_of_the_7b():
    assert kv_pool_shape(QWEN25_CODER_7B, 10) == (28, 10, 2, 4, 16, 128)
    # one page slice (one layer, K or V, one KV head) is 16 x 128 fp16 = 4 KiB
    assert PAGE_SIZE * QWEN25_CODER_7B.head_dim * 2 == 4096
    assert kv_bytes_per_token(QWEN25_CODER_7B) == 28 * 2 * 4 * 128 * 2  # 56 KiB per position


def test_allocate_and_free():
    allocator = PageAllocator(5)
    table = allocator.allocate(3)
    assert table.dtype == np.int32 and len(set(table.tolist())) == 3
    assert allocator.num_free == 2
    with pytest.raises(KVCacheFullError, match=r"asked for 3 pages .*2 of 5 are free"):
        allocator.allocate(3)
    assert allocator.num_free == 2  # a refused request takes nothing
    allocator.free(table)
    assert allocator.num_free == 5
    assert len(allocator.allocate(5)) == 5


def test_bad_frees_and_sizes():
    allocator = PageAllocator(4)
    table = allocator.allocate(2)
    allocator.free(table)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(table)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([7])
    table = allocator.allocate(1)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([table[0], table[0]])
    with pytest.raises(ValueError):
        PageAllocator(0)
    with pytest.raises(ValueError):
        allocator.allocate(-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_allocator_never_hands_out_a_page_twice(operations):
    allocator, held = PageAllocator(12), []
    for allocate, n in operations:
        if allocate:
            try:
                held.append(allocator.allocate(n))
            except KVCacheFullError:
                assert n > allocator.num_free
        elif held:
            allocator.free(held.pop(n % len(held)))
        in_use = np.concatenate(held) if held else np.array([], np.int32)
        assert len(set(in_use.tolist())) == len(in_use)
        assert allocator.num_free + len(in_use) == 12
        assert ((0 <= in_use) & (in_use < 12)).all()


def test_position_to_page_and_row():
    """Position p of a sequence lives in page table[p // 16], row p % 16, in every layer."""
    config = ModelConfig(num_layers=2, hidden_size=128, intermediate_size=128, num_heads=2, num_kv_heads=1,
                         head_dim=64, vocab_size=16, max_position_embeddings=64, rope_theta=1e4,
                         rms_norm_eps=1e-6, tie_word_embeddings=True)
    pool = np.full(kv_pool_shape(config, 6), np.nan, np.float16)
    table = np.array([4, 1, 3], np.int32)  # scattered pages, out of order
    positions = np.arange(37)  # page 3 holds 5 of 16 rows: a partly filled tail
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((37, 1, 64)).astype(np.float32) for _ in range(2))
    ops.write_kv(pool, 1, k, v, positions, table)
    assert np.array_equal(pool[1, 1, 0, 0, 20 - 16], k[20, 0].astype(np.float16))
    assert np.array_equal(pool[1, 3, 1, 0, 36 - 32], v[36, 0].astype(np.float16))
    assert np.isnan(pool[1, 3, :, :, 5:]).all() and np.isnan(pool[0]).all() and np.isnan(pool[1, [0, 2, 5]]).all()
