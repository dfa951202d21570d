"""Paged attention on the GPU: the launch side of kernels/paged_attention.cu.

    attention = PagedAttention(config, num_pages, max_seq_len)
    attention.decode(q, kv_pool[layer], page_table, seq_len, out)            # one new token
    attention.prefill(q, kv_pool[layer], page_table, start_pos, num_tokens, out)

Shapes (H = num_heads, D = head_dim, KVH = num_kv_heads, P = pages in the pool):

    q           decode: fp32 [H*D]          prefill: fp32 [T, H*D]   (RoPE already applied)
    kv_layer    fp16 [P, 2, KVH, 16, D]     one layer of the pool (a view, not a copy)
    page_table  int32 [pages of the sequence]
    seq_len     int32 [1] in device memory: positions to attend to, the new token included
    out         decode: fp16 [H*D]          prefill: fp16 [T, H*D]

`decode` takes the sequence length from device memory and launches two kernels, the split
decode and the merge of the splits, with grids sized for `max_seq_len`: the launches never
change from one step to the next, so a CUDA graph captured once replays them for every token.
`prefill` is one tensor-core kernel. The oracle is `nanoqwen.reference.ops.paged_attention`;
chapter 5 explains the kernels (and `kernels/paged_attention_broken.cu`, the deliberately
broken decode that `nanoqwen.book.broken_attention.BrokenPagedAttention` builds).

Nothing here imports CuPy until a kernel is built, so the planning helpers run on any machine.
"""

from __future__ import annotations

import numpy as np

from ..config import PAGE_SIZE, ModelConfig
from ..errors import ConfigError
from .abi import kernel_int
from . import build as cuda_build
from .device import set_carveout
from .launch import StepKernel

__all__ = [
    "PagedAttention",
    "check_config",
    "decode_splits",
    "random_paged_cache",
    "relative_error",
    "split_pages",
]

KERNEL_FILE = "paged_attention.cu"
MAX_GQA = kernel_int("paged_attention.cu", "DECODE_HEAD_ROWS")  # query heads one KV head's MMA rows hold
DECODE_BLOCKS_PER_SM = 2  # the decode kernel's __launch_bounds__ minimum
PREFILL_TOKENS = 16  # query rows per prefill block (kernels/paged_attention.cu PREFILL_TOKENS)


def check_config(config: ModelConfig) -> None:
    """Refuse, at load and naming the reason, shapes the CUDA kernels are not built for (the
    NumPy backend runs them all)."""
    if config.head_dim % 32 or config.head_dim > 128:
        raise ConfigError(f"the CUDA backend's paged attention needs head_dim a multiple of 32 up to 128, "
                          f"got {config.head_dim} (the numpy backend runs it)")
    if config.num_heads % config.num_kv_heads:
        raise ConfigError(f"num_heads={config.num_heads} is not a multiple of num_kv_heads={config.num_kv_heads}")
    if config.num_heads // config.num_kv_heads > MAX_GQA:
        raise ConfigError(f"the CUDA backend's decode attention serves at most {MAX_GQA} query heads per KV head, "
                          f"got {config.num_heads // config.num_kv_heads} (the numpy backend runs it)")


def decode_splits(num_kv_heads: int, max_seq_len: int, num_sms: int, blocks_per_sm: int = DECODE_BLOCKS_PER_SM) -> int:
    """Blocks per KV head of the decode grid: enough that KVH x splits blocks fill every SM
    `blocks_per_sm` times over, but never more than the longest sequence has pages."""
    max_pages = -(-max_seq_len // PAGE_SIZE)
    return max(1, min(max_pages, -(-blocks_per_sm * num_sms // num_kv_heads)))


def split_pages(seq_len: int, splits: int) -> list[tuple[int, int]]:
    """(first page, page count) of each block that has work, as the decode kernel divides a
    sequence of `seq_len` positions among a grid of `splits` blocks per KV head
    (kernels/paged_attention.cuh, divide_sequence): a block per page while the pages fit
    the grid, else equal runs of whole pages for half of it, one block per SM."""
    num_pages = -(-seq_len // PAGE_SIZE)
    if num_pages == 0:
        return []
    per_split = 1 if num_pages <= splits else -(-num_pages // -(-splits // 2))
    return [(first, min(per_split, num_pages - first)) for first in range(0, num_pages, per_split)]


class PagedAttention:
    """Decode and prefill attention for one model shape, compiled at construction."""

    launches_per_decode = 2  # the split decode kernel, then the kernel that merges the splits
    kernel_file = KERNEL_FILE
    decode_kernel = "paged_attention_decode"

    def __init__(self, config: ModelConfig, num_pages: int, max_seq_len: int, splits: int | None = None):
        import cupy as cp

        check_config(config)
        for name, value in (("num_pages", num_pages), ("max_seq_len", max_seq_len)):
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.config = config
        self.num_pages = int(num_pages)
        self.max_seq_len = int(max_seq_len)
        self.gqa = config.num_heads // config.num_kv_heads
        module = cuda_build.compile_module(config, files=(self.kernel_file,))
        # Inside the decode graph's capture, the kernels that wait for their predecessor launch
        # with programmatic dependent launch (nanoqwen.cuda.launch); elsewhere plainly.
        self._decode = StepKernel(module.get_function(self.decode_kernel), self.decode_kernel)
        self._prefill = StepKernel(module.get_function("paged_attention_prefill"), "paged_attention_prefill")
        self._combine = StepKernel(module.get_function("paged_attention_combine"), "paged_attention_combine")

        self.decode_threads = cuda_build.module_int(module, "paged_attention_decode_threads")
        self.decode_smem = cuda_build.module_int(module, "paged_attention_decode_smem_bytes")
        self.prefill_threads = cuda_build.module_int(module, "paged_attention_prefill_threads")
        self.prefill_smem = cuda_build.module_int(module, "paged_attention_prefill_smem_bytes")
        self.combine_threads = cuda_build.module_int(module, "paged_attention_combine_threads")
        max_splits = cuda_build.module_int(module, "paged_attention_combine_max_splits")
        self._decode.max_dynamic_shared_size_bytes = self.decode_smem
        self._prefill.max_dynamic_shared_size_bytes = self.prefill_smem
        # The combine's 4 KB of shared memory fit the smallest L1/shared split, so it asks for that.
        # Left to the driver's choice, the split depends on what the process ran before: on an H100
        # a process's first 7B engine stepped 2.3% slower than the ones after it (chapter 7).
        set_carveout(self._combine, 0)

        num_sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.splits = splits or decode_splits(config.num_kv_heads, max_seq_len, num_sms)
        if not isinstance(self.splits, int) or not 0 < self.splits <= max_splits:
            raise ValueError(f"splits must be an integer in 1..{max_splits}, got {splits!r}")
        kvh, d = config.num_kv_heads, config.head_dim
        # Each split's share: running max and sum per head, and the unnormalized weighted V.
        self.partial_max_sum = cp.empty((kvh, self.splits, self.gqa, 2), dtype=cp.float32)
        self.partial_acc = cp.empty((kvh, self.splits, self.gqa, d), dtype=cp.float32)
        self.rows_reserved = 1

    def reserve_rows(self, rows: int) -> None:
        """Make room for `decode` of up to `rows` rows at once (a verify pass): each row keeps its
        own splits' partials. It replaces the partial buffers, so call it before any graph that
        launches `decode` is captured (CudaBackend does, at construction)."""
        if rows > self.rows_reserved:
            import cupy as cp

            c = self.config
            self.partial_max_sum = cp.empty((rows, c.num_kv_heads, self.splits, self.gqa, 2), dtype=cp.float32)
            self.partial_acc = cp.empty((rows, c.num_kv_heads, self.splits, self.gqa, c.head_dim), dtype=cp.float32)
            self.rows_reserved = rows

    # ------------------------------------------------------------------ checks

    def _check_pool(self, kv_layer) -> None:
        c = self.config
        expected = (2, c.num_kv_heads, PAGE_SIZE, c.head_dim)
        if kv_layer.dtype.name != "float16" or kv_layer.ndim != 5 or tuple(kv_layer.shape[1:]) != expected:
            raise ValueError(
                f"kv_layer must be fp16 [pages, {', '.join(map(str, expected))}] (one layer of the pool), "
                f"got {kv_layer.dtype} {tuple(kv_layer.shape)}"
            )
        if not kv_layer.flags.c_contiguous:
            raise ValueError("kv_layer must be C-contiguous (kv_pool[layer] of a contiguous pool)")

    @staticmethod
    def _check(name: str, array, dtype: str, shape: tuple) -> None:
        if array.dtype.name != dtype or tuple(array.shape) != shape or not array.flags.c_contiguous:
            raise ValueError(f"{name} must be a contiguous {dtype} array of shape {shape}, got {array.dtype} {tuple(array.shape)}")

    # ------------------------------------------------------------------ launches

    def decode(self, q, kv_layer, page_table, seq_len, out, stream=None, rows: int = 1) -> None:
        """Attention of one new token over the `seq_len[0]` cached positions (its own included);
        with `rows` (a verify pass, at most `rows_reserved`), of q [rows, q_dim]: row r is the token
        at position seq_len[0] - 1 + r and attends over seq_len[0] + r positions.

        Launch configuration and arguments do not depend on the sequence length: capture-safe.
        """
        import cupy as cp

        q_dim = self.config.q_dim
        if not 1 <= rows <= self.rows_reserved:
            raise ValueError(f"rows must be in 1..{self.rows_reserved} (reserve_rows), got {rows!r}")
        shape = (rows * q_dim,) if q.ndim == 1 else (rows, q_dim)
        self._check("q", q, "float32", shape)
        self._check("out", out, "float16", shape)
        self._check("seq_len", seq_len, "int32", (1,))
        self._check_pool(kv_layer)
        if page_table.dtype.name != "int32" or page_table.ndim != 1:
            raise ValueError(f"page_table must be a 1-D int32 array, got {page_table.dtype} {page_table.shape}")
        if page_table.shape[0] * PAGE_SIZE < min(self.max_seq_len, self.num_pages * PAGE_SIZE):
            raise ValueError(
                f"page_table has {page_table.shape[0]} entries, too few for max_seq_len={self.max_seq_len}: "
                "the kernel reads the length from device memory and cannot check it"
            )
        with stream if stream is not None else cp.cuda.get_current_stream():
            kvh = self.config.num_kv_heads
            self._decode(
                (self.splits, kvh, rows), (self.decode_threads,),
                (q, kv_layer, page_table, seq_len, out, self.partial_max_sum, self.partial_acc),
                shared_mem=self.decode_smem,
            )
            self._combine(
                (self.gqa, kvh, rows), (self.combine_threads,),
                (seq_len, self.partial_max_sum, self.partial_acc, np.int32(self.splits), out),
            )

    def prefill(self, q, kv_layer, page_table, start_pos: int, num_tokens: int, out) -> None:
        """Causal attention of `num_tokens` queries at positions start_pos.. over the cache,
        whose positions < start_pos + num_tokens hold K and V already."""
        for name, value in (("start_pos", start_pos), ("num_tokens", num_tokens)):
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if num_tokens == 0:
            return
        q_dim = self.config.q_dim
        self._check("q", q, "float32", (num_tokens, q_dim))
        self._check("out", out, "float16", (num_tokens, q_dim))
        self._check_pool(kv_layer)
        end = start_pos + num_tokens
        if end > self.max_seq_len:
            raise ValueError(f"start_pos + num_tokens = {end} exceeds max_seq_len={self.max_seq_len}")
        if page_table.dtype.name != "int32" or page_table.ndim != 1 or page_table.shape[0] * PAGE_SIZE < end:
            raise ValueError(
                f"page_table must be 1-D int32 with at least {-(-end // PAGE_SIZE)} pages for {end} positions, "
                f"got {page_table.dtype} {page_table.shape}"
            )
        self._prefill(
            (-(-num_tokens // PREFILL_TOKENS), self.config.num_kv_heads), (self.prefill_threads,),
            (q, kv_layer, page_table, np.int32(start_pos), np.int32(num_tokens), out),
            shared_mem=self.prefill_smem,
        )

    # ------------------------------------------------------------------ accounting

    def decode_kv_bytes(self, seq_len: int) -> int:
        """Bytes of K and V one decode call must read for one layer: the byte floor."""
        return -(-seq_len // PAGE_SIZE) * PAGE_SIZE * 2 * self.config.kv_dim * 2

    def prefill_flops(self, start_pos: int, num_tokens: int) -> float:
        """Multiply-adds x 2 of QK^T and PV over the visible (causal) positions."""
        visible = sum(start_pos + t + 1 for t in range(num_tokens))
        return 4.0 * self.config.num_heads * self.config.head_dim * visible


# ---------------------------------------------------------------------- checking helpers


def random_paged_cache(config: ModelConfig, seq_len: int, rng: np.random.Generator, spare_pages: int = 3):
    """A one-layer pool fp16 [1, P, 2, KVH, 16, D] holding a sequence of `seq_len` random
    positions under a shuffled page table, and that table (int32).

    Every row the sequence does not own (the tail page's last rows, `spare_pages` pages no
    table names) is NaN: a kernel that reads past the sequence or through a wrong page id
    turns its output into NaN instead of a plausible number.
    """
    pages = -(-seq_len // PAGE_SIZE)
    total = pages + spare_pages
    shape = (1, total, 2, config.num_kv_heads, PAGE_SIZE, config.head_dim)
    pool = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    table = rng.permutation(total)[:pages].astype(np.int32)
    unused = np.setdiff1d(np.arange(total), table)
    pool[0, unused] = np.nan
    tail_rows = pages * PAGE_SIZE - seq_len
    if tail_rows:
        pool[0, table[-1], :, :, PAGE_SIZE - tail_rows :, :] = np.nan
    return pool, table


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| in float64; infinite if `out` holds a NaN or infinity."""
    out = np.asarray(out, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
