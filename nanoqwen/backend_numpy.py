"""The numpy backend: the Qwen2 forward pass composed from the oracle ops, on the CPU.

It is slow and simple on purpose. Every CUDA kernel is checked against `nanoqwen.ops_numpy`,
and this file shows how those ops chain into a model, so a wrong answer from the GPU can be
bisected op by op against the same chain. It implements the backend protocol that
`nanoqwen.engine.Engine` drives (see `nanoqwen.engine.Backend`).
"""

from __future__ import annotations

import numpy as np

from . import ops_numpy as ops
from .config import PAGE_SIZE
from .kvcache import kv_pool_shape
from .loader import LayerWeights, Model
from .quant import dequantize_int4

# fp32 copies of the INT4 weights cost 8x their packed size. Below this budget they are made
# once (a tiny test model decodes in milliseconds); above it (a 7B model would need ~28 GB)
# each projection is dequantized when it runs, so large models work, slowly.
WEIGHT_CACHE_BYTES = 2 * 2**30
# Prefill runs in chunks so attention's [heads, T, S] score matrix stays small for long
# prompts; chunks are exact because each chunk reads earlier positions back from the cache.
PREFILL_CHUNK = 512

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


class NumpyBackend:
    name = "numpy"

    def __init__(self, model: Model, num_pages: int, weight_cache_bytes: int = WEIGHT_CACHE_BYTES):
        self.model = model
        self.config = model.config
        self.num_pages = num_pages
        self.layers: list[LayerWeights] = [model.layer(i) for i in range(self.config.num_layers)]
        # Zeros cost nothing until touched (the OS maps pages lazily); nothing reads a row
        # before its sequence wrote it, which the tests check by poisoning the pool with NaN.
        self.kv_pool = np.zeros(kv_pool_shape(self.config, num_pages), dtype=np.float16)
        dense_bytes = 4 * sum(getattr(layer, p).out_features * getattr(layer, p).in_features
                              for layer in self.layers for p in PROJECTIONS)
        self.weights_cached = dense_bytes <= weight_cache_bytes
        self._dense: dict[tuple[int, str], np.ndarray] = {}
        if self.weights_cached:
            for i, layer in enumerate(self.layers):
                for p in PROJECTIONS:
                    linear = getattr(layer, p)
                    self._dense[i, p] = dequantize_int4(linear.qweight, linear.scales)

    def _linear(self, x: np.ndarray, layer: int, projection: str) -> np.ndarray:
        linear = getattr(self.layers[layer], projection)
        return ops.int4_linear(x, linear, self._dense.get((layer, projection)))

    def _layer(self, i: int, x: np.ndarray, h: np.ndarray, positions: np.ndarray, page_table: np.ndarray,
               next_norm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One decoder layer on T tokens. x: residual [T, H] fp32, h: its normed fp16 copy.

        Returns the new residual and its RMSNorm under `next_norm` (the next layer's input
        norm, or the final norm), the fusion the GPU kernels use too.
        """
        c, w = self.config, self.layers[i]
        t = x.shape[0]
        q = self._linear(h, i, "q").reshape(t, c.num_heads, c.head_dim)  # [T, heads, D] fp32
        k = self._linear(h, i, "k").reshape(t, c.num_kv_heads, c.head_dim)  # [T, KVH, D] fp32
        v = self._linear(h, i, "v").reshape(t, c.num_kv_heads, c.head_dim)
        q = ops.apply_rope(q, positions, c.rope_theta)
        k = ops.apply_rope(k, positions, c.rope_theta)
        ops.write_kv(self.kv_pool, i, k, v, positions, page_table)  # stored fp16
        attn = ops.paged_attention(q, self.kv_pool, i, page_table, positions)  # [T, heads, D] fp32
        o = self._linear(attn.reshape(t, c.q_dim).astype(np.float16), i, "o")  # [T, H] fp32
        x, h = ops.add_rmsnorm(x, o, w.post_norm, c.rms_norm_eps)
        mlp = ops.silu_mul(self._linear(h, i, "gate"), self._linear(h, i, "up"))  # [T, I] fp16
        return ops.add_rmsnorm(x, self._linear(mlp, i, "down"), next_norm, c.rms_norm_eps)

    def _forward(self, token_ids: np.ndarray, positions: np.ndarray, page_table: np.ndarray) -> np.ndarray:
        """Run tokens at `positions` through every layer; logits [vocab] fp32 of the last one."""
        c = self.config
        x = ops.embed(token_ids, self.model.embed)  # [T, H] fp32
        h = ops.rmsnorm(x, self.layers[0].input_norm, c.rms_norm_eps)  # [T, H] fp16
        for i in range(c.num_layers):
            next_norm = self.layers[i + 1].input_norm if i + 1 < c.num_layers else self.model.final_norm
            x, h = self._layer(i, x, h, positions, page_table, next_norm)
        return ops.fp16_linear(h[-1:], self.model.lm_head)[0]  # [vocab] fp32

    def _check(self, first: int, count: int, page_table: np.ndarray) -> np.ndarray:
        page_table = np.asarray(page_table, dtype=np.int32)
        if first < 0 or (first + count - 1) // PAGE_SIZE >= len(page_table):
            raise ValueError(
                f"positions {first}..{first + count - 1} need {(first + count - 1) // PAGE_SIZE + 1} pages, "
                f"the page table has {len(page_table)}"
            )
        if len(page_table) and not (0 <= page_table.min() and page_table.max() < self.num_pages):
            raise ValueError(f"page table holds ids outside 0..{self.num_pages - 1}")
        return page_table

    def prefill(self, token_ids: np.ndarray, start_pos: int, page_table: np.ndarray) -> np.ndarray:
        """Write K/V of `token_ids` [T] at start_pos.. into the cache; logits of the last token."""
        token_ids = np.asarray(token_ids, dtype=np.int32)
        if token_ids.ndim != 1 or len(token_ids) == 0:
            raise ValueError(f"prefill needs a 1-D array of at least one token id, got shape {token_ids.shape}")
        page_table = self._check(start_pos, len(token_ids), page_table)
        for begin in range(0, len(token_ids), PREFILL_CHUNK):
            chunk = token_ids[begin : begin + PREFILL_CHUNK]
            positions = np.arange(start_pos + begin, start_pos + begin + len(chunk))
            logits = self._forward(chunk, positions, page_table)
        return logits

    def decode(self, token_id: int, position: int, page_table: np.ndarray) -> np.ndarray:
        """One token at `position` (its K/V is written there); logits [vocab] fp32."""
        page_table = self._check(position, 1, page_table)
        return self._forward(np.array([token_id], dtype=np.int32), np.array([position]), page_table)

    def decode_greedy(self, token_id: int, position: int, page_table: np.ndarray) -> int:
        return int(np.argmax(self.decode(token_id, position, page_table)))
