"""Every operation of the Qwen2 forward pass as a plain numpy function: the oracle.

The numpy backend composes these; every CUDA kernel is tested against them. Numerics follow
ARCHITECTURE.md: fp32 residual stream and accumulation, fp16 activations into projections,
fp16 K/V in the paged cache. Shapes use T = tokens, H = hidden, D = head_dim.
"""

from __future__ import annotations

import numpy as np

from ..config import PAGE_SIZE
from ..loader import Int4Linear
from ..quant import dequantize_int4


def embed(token_ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[T] int -> [T, H] fp32 rows of the fp16 embedding table."""
    return table[token_ids].astype(np.float32)


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """[T, H] fp32 -> [T, H] fp16: x / rms(x) * weight, computed in fp32."""
    inv_rms = 1.0 / np.sqrt(np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True) + np.float32(eps))
    return (x * inv_rms * weight.astype(np.float32)).astype(np.float16)


def add_rmsnorm(residual: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float):
    """The fused residual step: returns (residual + delta, rmsnorm(residual + delta))."""
    residual = residual + delta
    return residual, rmsnorm(residual, weight, eps)


def int4_linear(x: np.ndarray, linear: Int4Linear, weight: np.ndarray | None = None) -> np.ndarray:
    """[T, K] fp16 @ INT4 [N, K]^T (+ bias) -> [T, N] fp32. `weight` is a cached dequantization."""
    if weight is None:
        weight = dequantize_int4(linear.qweight, linear.scales)
    y = x.astype(np.float32) @ weight.T
    if linear.bias is not None:
        y += linear.bias.astype(np.float32)
    return y


def fp16_linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """[T, K] fp16 @ fp16 [N, K]^T -> [T, N] fp32 (the lm_head)."""
    return x.astype(np.float32) @ weight.astype(np.float32, copy=False).T


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """[D/2] fp32 inverse frequencies, computed as transformers does (fp32 throughout)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def apply_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """[T, heads, D] fp32 rotated by split halves: dim i pairs with dim i + D/2."""
    half = x.shape[-1] // 2
    angles = positions.astype(np.float32)[:, None] * rope_inv_freq(x.shape[-1], theta)[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(np.float32)


def write_kv(kv_pool: np.ndarray, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray, page_table: np.ndarray) -> None:
    """Store K and V ([T, KVH, D] fp32) as fp16 at their positions' page slots, in place."""
    pages = page_table[positions // PAGE_SIZE]
    rows = positions % PAGE_SIZE
    kv_pool[layer, pages, 0, :, rows, :] = k.astype(np.float16)
    kv_pool[layer, pages, 1, :, rows, :] = v.astype(np.float16)


def gather_kv(kv_pool: np.ndarray, layer: int, page_table: np.ndarray, length: int):
    """Positions 0..length-1 of one sequence: (K, V), each [length, KVH, D] fp32."""
    positions = np.arange(length)
    pages = page_table[positions // PAGE_SIZE]
    rows = positions % PAGE_SIZE
    k = kv_pool[layer, pages, 0, :, rows, :].astype(np.float32)
    v = kv_pool[layer, pages, 1, :, rows, :].astype(np.float32)
    return k, v


def paged_attention(q: np.ndarray, kv_pool: np.ndarray, layer: int, page_table: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Causal GQA attention of queries [T, heads, D] fp32 at `positions` over the paged cache.

    Query t sees cache positions 0..positions[t]. Query head h reads KV head h // (heads/KVH).
    Returns [T, heads, D] fp32.
    """
    num_tokens, num_heads, head_dim = q.shape
    k, v = gather_kv(kv_pool, layer, page_table, int(positions.max()) + 1)
    group = num_heads // k.shape[1]
    k = np.repeat(k, group, axis=1)  # [S, heads, D]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) * np.float32(head_dim**-0.5)
    visible = np.arange(k.shape[0])[None, :] <= positions[:, None]  # [T, S]
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", weights, v).astype(np.float32)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU's elementwise half: silu(gate) * up in fp32, returned as fp16 for down_proj."""
    return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float16)
