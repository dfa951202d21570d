"""The byte floor of a decode step: the bytes one token must read, and the time they take.

At batch 1 a decode step multiplies every weight once, two FLOPs per weight, so it is bound by
memory: its fastest possible time is the bytes it must read over the GPU's read bandwidth. Every
speed the book and `nanoqwen bench` report is measured against this floor.
"""

from __future__ import annotations

from .config import ModelConfig

READ_BANDWIDTH = 4.49e12  # bytes/s: a read-only streaming kernel on an H200


def bytes_per_token(config: ModelConfig, context: int) -> dict[str, int]:
    """Bytes one decode step must read at `context` cached positions, by kind."""
    c, g = config, config.group_size
    linear_params = c.num_layers * (
        c.hidden_size * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    )
    return {
        "int4 weights": linear_params // 2,
        "fp16 scales": linear_params // g * 2,
        "fp16 lm_head": c.vocab_size * c.hidden_size * 2,
        "kv cache": 2 * c.num_layers * c.kv_dim * 2 * context,
        "embedding row, biases, norms": 2 * (c.hidden_size + c.num_layers * (c.q_dim + 2 * c.kv_dim + 2 * c.hidden_size) + c.hidden_size),
    }


def floor_ms(config: ModelConfig, context: int, bandwidth: float = READ_BANDWIDTH) -> float:
    """The fastest a decode step at `context` cached positions can be, in milliseconds."""
    return sum(bytes_per_token(config, context).values()) / bandwidth * 1e3


def int4_bytes(out_features: int, in_features: int, group_size: int) -> int:
    """Packed nibbles plus one fp16 scale per group."""
    return out_features * in_features // 2 + out_features * in_features // group_size * 2


def kernel_bytes(config: ModelConfig, context: int, rope_in_qkv: bool = True) -> dict[str, int]:
    """The byte floor of one decode step (`bytes_per_token`), by the kernel that reads each byte:
    the step's kernels with RoPE in the q|k|v GEMV (the fp16 engine's default), or, not
    `rope_in_qkv`, with the plain GEMV and rope_write_kv (CudaBackend.rope_in_qkv)."""
    L, H, I, g = config.num_layers, config.hidden_size, config.intermediate_size, config.group_size
    qkv = config.q_dim + 2 * config.kv_dim
    qkv_bytes = L * (int4_bytes(qkv, H, g) + 2 * qkv)  # + q, k, v biases
    return {
        "embed_tokens": 2 * H,  # one row of the embedding
        "add_rmsnorm_cluster": (2 * L + 1) * 2 * H,  # a norm weight each: 2 per layer + the final norm
        **({"gemv_int4_qkv_rope": qkv_bytes} if rope_in_qkv else {"gemv_int4_from_hidden": qkv_bytes, "rope_write_kv": 0}),
        "attention_decode": L * 2 * config.kv_dim * 2 * context,  # K and V of every cached position
        "gemv_int4_from_q_dim": L * int4_bytes(H, config.q_dim, g),
        "gemv_int4_gate_up_silu": L * int4_bytes(2 * I, H, g),
        "gemv_int4_from_intermediate": L * int4_bytes(H, I, g),
        "lm_head_logits": config.vocab_size * H * 2,
        "argmax_select_next": 0,
    }
