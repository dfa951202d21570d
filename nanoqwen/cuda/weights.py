"""The model's weights on the device: upload, the GEMVs' tiled layout, prefill's fp16 copies.

At upload q, k and v are stacked into one INT4 matrix and gate and up into another, so each pair
of projections that shares an input is one GEMV; the packed words are re-tiled for the decode
GEMVs (nanoqwen.quant.tile_int4) and the scales stay row-major. Prefill multiplies with cuBLAS
from fp16 matrices: kept for every projection ("cache") or expanded per prompt ("expand").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..loader import Int4Linear
from ..quant import tile_int4
from .device import free_device_bytes
from .plan import projection_splits

PREFILL_WEIGHTS = ("auto", "cache", "expand")  # where prefill's fp16 matrices come from
# "auto" keeps fp16 copies of the projections for prefill when this much device memory stays free
# after them (prefill's activations for a chunk of the 7B take ~0.3 GB).
PREFILL_CACHE_HEADROOM_BYTES = 2 * 2**30


@dataclass
class DeviceLinear:
    """One INT4 projection on the device, its packed weights in the GEMVs' tiled layout
    (quant.tile_int4); `splits` is its split-K factor in decode."""

    qweight: object  # cupy uint32 [tiles, in/128, 16, 16]
    scales: object  # cupy float16 [out, in/128], row-major
    bias: object | None  # cupy float16 [out]
    bias32: object | None  # cupy float32 [out]: prefill's GEMM starts from it
    out_features: int
    in_features: int
    splits: int
    dense: object | None = None  # cupy float16 [out, in]: the dequantized matrix, when prefill keeps it


@dataclass
class DeviceLayer:
    input_norm: object  # cupy float16 [H]
    post_norm: object
    qkv: DeviceLinear  # q, k, v rows stacked: [Q + 2 KV, H]
    o: DeviceLinear
    gate_up: DeviceLinear  # gate rows then up rows: [2 I, H]
    down: DeviceLinear


def stack_linears(linears: list[Int4Linear]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Projections that share an input, stacked row-wise into one matrix: (qweight, scales, bias)."""
    in_features = linears[0].in_features
    if any(lin.in_features != in_features for lin in linears):
        raise ValueError("projections stacked into one matrix must share their input size")
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise ValueError("projections stacked into one matrix must all have a bias or none")
    return (np.concatenate([lin.qweight for lin in linears]), np.concatenate([lin.scales for lin in linears]),
            None if biases[0] is None else np.concatenate(biases))


class WeightUpload:
    """CudaBackend's part that puts the model on the device (layers, prefill's fp16 copies, Path A's own copy)."""

    def _upload_linear(self, projection: str, linears: list[Int4Linear]) -> DeviceLinear:
        """Stack `linears` into one matrix and upload it, the packed words tiled on the device."""
        cp = self._cp
        qweight, scales, bias = stack_linears(linears)
        bias = None if bias is None else cp.asarray(bias)
        out_features, in_features = qweight.shape[0], qweight.shape[1] * 8
        return DeviceLinear(
            qweight=tile_int4(cp.asarray(qweight), xp=cp),
            scales=cp.asarray(scales),
            bias=bias,
            bias32=None if bias is None else bias.astype(cp.float32),
            out_features=out_features,
            in_features=in_features,
            splits=projection_splits(projection, out_features, in_features, self.num_sms, self.config.group_size,
                                     self.sm),
        )

    def _upload_layer(self, w) -> DeviceLayer:
        cp = self._cp
        return DeviceLayer(
            input_norm=cp.asarray(w.input_norm),
            post_norm=cp.asarray(w.post_norm),
            qkv=self._upload_linear("qkv", [w.q, w.k, w.v]),
            o=self._upload_linear("o", [w.o]),
            gate_up=self._upload_linear("gate_up", [w.gate, w.up]),
            down=self._upload_linear("down", [w.down]),
        )

    def _linears(self):
        for layer in self.layers:
            yield from (layer.qkv, layer.o, layer.gate_up, layer.down)

    def _keep_dense_weights(self, policy: str) -> str:
        """Apply the prefill_weights policy; returns "cache" or "expand", what prefill will do."""
        cp = self._cp
        dense_bytes = sum(2 * lin.out_features * lin.in_features for lin in self._linears())
        if policy == "auto":
            policy = "cache" if free_device_bytes() >= dense_bytes + PREFILL_CACHE_HEADROOM_BYTES else "expand"
        if policy == "cache":
            with self.stream:
                for linear in self._linears():
                    linear.dense = cp.empty((linear.out_features, linear.in_features), dtype=cp.float16)
                    self._dequantize_into(linear, linear.dense)
        return policy

    def _int8_projections(self, layer: int) -> dict:
        """Path A launchers for one layer's four projections. Path A's kernel reads the file's
        row-major layout, so it gets its own copy of the weights (chapter 8 compares the paths;
        only this mode pays the memory)."""
        from .int8 import Int8Gemv

        cp, w = self._cp, self.model.layer(layer)
        projections = {}
        for name, linears in (("qkv", [w.q, w.k, w.v]), ("o", [w.o]), ("gate_up", [w.gate, w.up]), ("down", [w.down])):
            qweight, scales, bias = stack_linears(linears)
            projections[name] = Int8Gemv(self.config, cp.asarray(qweight), cp.asarray(scales),
                                         None if bias is None else cp.asarray(bias))
        return projections
