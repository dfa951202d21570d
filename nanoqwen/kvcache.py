"""The paged KV cache: a pool of 16-token pages and the allocator that hands them out.

One pool per engine holds K and V of every layer:

    kv_pool  float16 [num_layers, num_pages, 2, num_kv_heads, PAGE_SIZE, head_dim]
                                            ^ 0 = K, 1 = V

A sequence owns a list of page ids, its *page table*: position p lives in page
`table[p // PAGE_SIZE]`, row `p % PAGE_SIZE`, and a page id names the same 16 positions in
every layer. Pages need not be contiguous or ordered, so sequences of any length share one
pool without fragmentation; only the last page of a sequence (its tail) is partly filled.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .config import PAGE_SIZE, ModelConfig
from .errors import KVCacheFullError

__all__ = [
    "PAGE_SIZE",
    "PageAllocator",
    "check_positions",
    "check_tokens",
    "kv_bytes_per_token",
    "kv_pool_shape",
    "pages_needed",
]



def pages_needed(num_tokens: int) -> int:
    """Pages that hold `num_tokens` positions: the last one may be partly filled."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // PAGE_SIZE)


def kv_pool_shape(config: ModelConfig, num_pages: int) -> tuple[int, int, int, int, int, int]:
    """(L, P, 2, KVH, 16, D): the layout every backend and kernel agrees on."""
    return (config.num_layers, num_pages, 2, config.num_kv_heads, PAGE_SIZE, config.head_dim)


def kv_bytes_per_token(config: ModelConfig) -> int:
    """fp16 K and V of one position across all layers: what each cached token costs."""
    return config.num_layers * 2 * config.kv_dim * 2


class PageAllocator:
    """Hands out page ids of a pool of `num_pages` pages and takes them back.

    The free list is a stack: pages freed last are handed out first, so a new request reuses
    pages that still hold another sequence's stale K/V. That is deliberate: attention must
    never read a row its own sequence has not written, and reuse makes any such bug visible.
    """

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, (int, np.integer)) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_pages = int(num_pages)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> np.ndarray:
        """`n` page ids as an int32 array (a page table), or KVCacheFullError."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise KVCacheFullError(
                f"KV cache full: asked for {n} pages ({n * PAGE_SIZE} tokens), "
                f"{len(self._free)} of {self.num_pages} are free"
            )
        # The top n of the stack at once, not popped in a loop: Ctrl-C's exception, raised between
        # bytecodes, cannot land after some pages and before the rest.
        pages = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        self._in_use.update(pages)
        return np.array(pages, dtype=np.int32)

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. Freeing a page that is not in use is a bug: it raises."""
        pages = [int(p) for p in np.asarray(pages, dtype=np.int64).reshape(-1)]
        unknown = [p for p in pages if p not in self._in_use]
        if unknown or len(set(pages)) != len(pages):
            raise ValueError(f"pages {unknown or pages} are not allocated (double free?)")
        self._in_use.difference_update(pages)
        self._free.extend(reversed(pages))


# ---- the checks every backend runs on its inputs, before any kernel reads an index ----


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_tokens(token_ids, vocab_size: int) -> np.ndarray:
    """`token_ids` as int32 [T], after checking it is a 1-D integer array of ids in 0..vocab_size-1.

    An id outside the vocabulary would index past the embedding table: on the GPU that reads
    other memory silently, so both backends refuse it here with the same message.
    """
    token_ids = np.asarray(token_ids)
    if token_ids.ndim != 1 or len(token_ids) == 0 or not np.issubdtype(token_ids.dtype, np.integer):
        raise ValueError(
            f"expected a 1-D integer array of at least one token id, got {token_ids.dtype}{list(token_ids.shape)}"
        )
    if token_ids.min() < 0 or token_ids.max() >= vocab_size:
        raise ValueError(f"token ids must lie in 0..{vocab_size - 1}, got {int(token_ids.min())}..{int(token_ids.max())}")
    return token_ids.astype(np.int32)


def check_positions(first: int, count: int, page_table, num_pages: int, max_seq_len: int) -> np.ndarray:
    """The page table as int32 [pages], after checking it can hold positions first..first+count-1.

    `num_pages` is the pool's size and `max_seq_len` the most positions one sequence may have
    (the smaller of the model's context and the backend's capacity). The table must be a 1-D
    integer array of distinct page ids in 0..num_pages-1, long enough for the last position and
    no longer than a `max_seq_len`-token sequence needs (the GPU's state buffer is that long).
    """
    if not (_is_int(first) and _is_int(count)) or count < 1:
        raise ValueError(f"positions need an integer start and a count >= 1, got first={first!r}, count={count!r}")
    first, count = int(first), int(count)
    page_table = np.asarray(page_table)
    if page_table.ndim != 1 or not np.issubdtype(page_table.dtype, np.integer):
        raise ValueError(f"page_table must be a 1-D integer array, got {page_table.dtype}{list(page_table.shape)}")
    last = first + count - 1
    if first < 0 or last >= max_seq_len:
        raise ValueError(f"positions {first}..{last} outside 0..{max_seq_len - 1} (the backend's maximum)")
    needed = last // PAGE_SIZE + 1
    if not needed <= len(page_table) <= pages_needed(max_seq_len):
        raise ValueError(
            f"positions {first}..{last} need {needed} pages; the page table has {len(page_table)} "
            f"(at most {pages_needed(max_seq_len)})"
        )
    if page_table.min() < 0 or page_table.max() >= num_pages:
        raise ValueError(f"page table holds ids outside 0..{num_pages - 1}")
    if len(np.unique(page_table)) != len(page_table):  # two positions would share one cache row
        raise ValueError("page table names a page twice")
    return page_table.astype(np.int32)
