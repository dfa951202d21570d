"""The INT8-path study of the book's INT8-vs-FP16 chapter: synthetic inputs and the error measure.

The product keeps Path A's oracle and launcher in nanoqwen.cuda.int8; what only the chapter, its
tests (tests/test_int8_path.py) and its benchmark (tools/bench_int8_vs_fp16.py) need lives here:
activations shaped like a normed hidden state, a random INT4 projection with the fp32 weights it
was quantized from, the float64 product both paths are judged against, and the error between two
outputs. Nothing here reads model weights.
"""

from __future__ import annotations

import numpy as np

from ..loader import Int4Linear
from ..quant import dequantize_int4, quantize_int4

# The study's shapes -> the engine projection whose split-K rule Path B follows (q, k and v run as
# q|k|v does)
PROJECTION_OF = {"q": "qkv", "k": "qkv", "v": "qkv", "qkv": "qkv", "o": "o", "gate+up": "gate_up", "down": "down"}


def dequantized_reference(x: np.ndarray, linear: Int4Linear) -> np.ndarray:
    """fp16 [K] -> float64 [N]: the fp16 activations times the dequantized fp32 weights, in
    float64. Both paths are judged against this: it is what the INT4 model means."""
    y = dequantize_int4(linear.qweight, linear.scales).astype(np.float64) @ np.asarray(x).astype(np.float64)
    if linear.bias is not None:
        y += linear.bias.astype(np.float64)
    return y


def error_vs_reference(y: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """rel_l2 = ||y - ref|| / ||ref||; max_rel = max|y - ref| / max|ref|."""
    y = np.asarray(y, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    diff = y - reference
    return {
        "rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(reference)),
        "max_rel": float(np.abs(diff).max() / np.abs(reference).max()),
    }


def synthetic_activations(in_features: int, rng: np.random.Generator, outlier_channels: float = 0.004,
                          outlier_gain: float = 20.0) -> np.ndarray:
    """fp16 [K] shaped like a normed hidden state: per-channel gains spread over a decade
    (lognormal), a few channels ~20x larger (the outlier channels LLMs are known for), and
    heavy tails within a channel (Laplace). Synthetic: no model weights are read."""
    gains = rng.lognormal(0.0, 0.6, in_features)
    outliers = rng.random(in_features) < outlier_channels
    gains[outliers] *= outlier_gain
    return (rng.laplace(0.0, 1.0, in_features) * gains).astype(np.float16)


def synthetic_projection(out_features: int, in_features: int, rng: np.random.Generator,
                         bias: bool = False) -> tuple[Int4Linear, np.ndarray]:
    """A random INT4 projection and the fp32 weights it was quantized from. Weights are
    Student-t with 5 degrees of freedom (tails somewhat heavier than a Gaussian's, as in
    trained weights) over sqrt(in_features), with a lognormal gain per row."""
    row_gain = rng.lognormal(0.0, 0.3, (out_features, 1))
    weight = (rng.standard_t(5, (out_features, in_features)) * row_gain / np.sqrt(in_features)).astype(np.float32)
    qweight, scales = quantize_int4(weight)
    b = (rng.standard_normal(out_features) * 0.1).astype(np.float16) if bias else None
    return Int4Linear(qweight, scales, b), weight
