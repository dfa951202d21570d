"""The numpy backend: the Qwen2 forward pass composed from the oracle ops, on the CPU.

It is slow and simple on purpose. Every CUDA kernel is checked against `nanoqwen.reference.ops`,
and this file shows how those ops chain into a model, so a wrong answer from the GPU can be
bisected op by op against the same chain. It implements the backend protocol that
`nanoqwen.engine.Engine` drives (see `nanoqwen.backends.Backend`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..config import PAGE_SIZE
from ..kvcache import check_positions, check_tokens, kv_pool_shape
from ..loader import LayerWeights, Model
from ..quant import dequantize_int4
from ..sampling import GREEDY, SamplingParams, sample
from ..speculative import MAX_DRAFTS, accepted_tokens
from . import ops

# fp32 copies of the INT4 weights cost 8x their packed size, of the fp16 lm_head 2x. Below
# this budget they are made once (a tiny test model decodes in milliseconds); above it (a 7B
# model would need ~28 GB) each projection is dequantized when it runs, so large models work,
# slowly. The projections get the budget first, the lm_head what is left.
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
        # The most positions one sequence may hold: the model's context or the pool, if smaller.
        self.max_seq_len = min(self.config.max_position_embeddings, num_pages * PAGE_SIZE)
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
        lm_head = model.lm_head
        cached_bytes = dense_bytes if self.weights_cached else 0
        self._lm_head_fp32 = None
        if cached_bytes + 4 * lm_head.size <= weight_cache_bytes:
            self._lm_head_fp32 = lm_head.astype(np.float32)  # [vocab, H]

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

    def _forward(self, token_ids: np.ndarray, positions: np.ndarray, page_table: np.ndarray,
                 logit_rows: slice | None = slice(-1, None)) -> np.ndarray | None:
        """Run tokens at `positions` through every layer; fp32 logits [rows, vocab] of `logit_rows`
        (the last token by default, every token for a verify pass).

        With logit_rows=None only the cache is written (a prefill chunk before the last).
        """
        c = self.config
        x = ops.embed(token_ids, self.model.embed)  # [T, H] fp32
        h = ops.rmsnorm(x, self.layers[0].input_norm, c.rms_norm_eps)  # [T, H] fp16
        for i in range(c.num_layers):
            next_norm = self.layers[i + 1].input_norm if i + 1 < c.num_layers else self.model.final_norm
            x, h = self._layer(i, x, h, positions, page_table, next_norm)
        if logit_rows is None:
            return None
        return ops.fp16_linear(h[logit_rows], self.model.lm_head if self._lm_head_fp32 is None else self._lm_head_fp32)

    def _check(self, token_ids, first: int, page_table) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and page table as int32, checked as the CUDA backend checks them."""
        token_ids = check_tokens(token_ids, self.config.vocab_size)
        return token_ids, check_positions(first, len(token_ids), page_table, self.num_pages, self.max_seq_len)

    def prefill(self, token_ids: np.ndarray, start_pos: int, page_table: np.ndarray) -> np.ndarray:
        """Write K/V of `token_ids` [T] at start_pos.. into the cache; logits of the last token."""
        token_ids, page_table = self._check(token_ids, start_pos, page_table)
        for begin in range(0, len(token_ids), PREFILL_CHUNK):
            chunk = token_ids[begin : begin + PREFILL_CHUNK]
            positions = np.arange(start_pos + begin, start_pos + begin + len(chunk))
            last = begin + PREFILL_CHUNK >= len(token_ids)
            logits = self._forward(chunk, positions, page_table, slice(-1, None) if last else None)
        return logits[0]

    def decode(self, token_id: int, position: int, page_table: np.ndarray) -> np.ndarray:
        """One token at `position` (its K/V is written there); logits [vocab] fp32."""
        token_ids, page_table = self._check([token_id], position, page_table)
        return self._forward(token_ids, np.array([position]), page_table)[0]

    def decode_next(self, token_id: int, position: int, page_table: np.ndarray,
                    sampling: SamplingParams = GREEDY) -> int:
        """`sample` of `decode`'s logits; non-finite logits raise FloatingPointError."""
        return sample(self.decode(token_id, position, page_table), sampling, position)

    def next_tokens(self, token_id: int, position: int, page_table: np.ndarray, steps: int,
                    sampling: SamplingParams = GREEDY):
        """The next `steps` tokens, one `decode_next` call each; nothing runs ahead, so a True sent
        in (Backend.next_tokens) stops it at once."""
        for k in range(steps):
            token_id = self.decode_next(token_id, position + k, page_table, sampling)
            if (yield token_id):
                return

    def verify_logits(self, token_id: int, drafts: Sequence[int], position: int, page_table: np.ndarray) -> np.ndarray:
        """Rows [token_id, *drafts] at position.. in one pass (K/V written there, each row attending
        causally over the cache and the rows before it); fp32 logits [len(drafts) + 1, vocab]."""
        if len(drafts) > MAX_DRAFTS:
            raise ValueError(f"a verify pass takes at most {MAX_DRAFTS} drafts, got {len(drafts)}")
        token_ids, page_table = self._check([token_id, *drafts], position, page_table)
        return self._forward(token_ids, np.arange(position, position + len(token_ids)), page_table, slice(None))

    def verify(self, token_id: int, drafts: Sequence[int], position: int, page_table: np.ndarray,
               sampling: SamplingParams = GREEDY) -> list[int]:
        """The tokens `accepted_tokens` takes from `verify_logits`' rows (see `Backend.verify`)."""
        return accepted_tokens(self.verify_logits(token_id, drafts, position, page_table), drafts, sampling, position)
