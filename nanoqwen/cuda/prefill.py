"""Prefill: whole prompts through cuBLAS, in chunks, writing the KV cache.

Each INT4 matrix is multiplied from fp16 (its kept copy, or an expansion into a scratch buffer)
with fp16 activations, accumulating in fp32 (cublasGemmEx). The only numerical difference from
the contract is that expansion's fp16 rounding of each weight (relative error <= 2^-11).
"""

from __future__ import annotations

import numpy as np

from .abi import ELEMENTWISE_THREADS
from .weights import DeviceLinear

PREFILL_CHUNK = 1024  # tokens per prefill pass: bounds the [T, 2 I] fp32 MLP buffer
CUDA_R_16F, CUDA_R_32F = 2, 0  # cudaDataType values


class Prefill:
    """CudaBackend's part that runs prompts."""

    def _gemm(self, x, weight, out, beta: float) -> None:
        """out [T, N] fp32 = x [T, K] fp16 @ weight [N, K]^T fp16 + beta * out, on the current stream.

        cuBLAS is column-major: the row-major out^T = weight x^T is its (N x T) = (N x K)(K x T).
        """
        from cupy_backends.cuda.libs import cublas

        num_tokens, k = x.shape
        n = weight.shape[0]
        handle = self._cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, self._cp.cuda.get_current_stream().ptr)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        alpha_host, beta_host = np.array(1.0, dtype=np.float32), np.array(beta, dtype=np.float32)
        cublas.gemmEx(
            handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, num_tokens, k,
            alpha_host.ctypes.data, weight.data.ptr, CUDA_R_16F, k,
            x.data.ptr, CUDA_R_16F, k,
            beta_host.ctypes.data, out.data.ptr, CUDA_R_32F, n,
            cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT,
        )

    def _expand(self, linear: DeviceLinear):
        """linear's weights as fp16 [out, in]: its kept copy, or an expansion into the shared
        scratch buffer."""
        if linear.dense is not None:
            return linear.dense
        cp = self._cp
        size = linear.out_features * linear.in_features
        if self._weight_scratch is None:
            largest = max(p.out_features * p.in_features for p in
                          (self.layers[0].qkv, self.layers[0].o, self.layers[0].gate_up, self.layers[0].down))
            self._weight_scratch = cp.empty(largest, dtype=cp.float16)
        dense = self._weight_scratch[:size].reshape(linear.out_features, linear.in_features)
        self._dequantize_into(linear, dense)
        return dense

    def _dequantize_into(self, linear: DeviceLinear, dense) -> None:
        words = linear.out_features * linear.in_features // 8
        self.kernels["dequantize_int4_to_half"](
            (self._elementwise_blocks(words),), (ELEMENTWISE_THREADS,),
            (linear.qweight, linear.scales, dense, np.int32(linear.out_features), np.int32(linear.in_features)),
        )

    def _prefill_buffers(self, rows: int) -> dict:
        """Prefill's activations for `rows` tokens: views of buffers allocated once, for the longest
        chunk so far, and zeroed when allocated. cuBLAS writes its outputs in ways compute-sanitizer's
        initcheck does not see, so a buffer first written by a GEMM would read as uninitialized; a
        memset it does see. Every row a chunk reads was written by that chunk."""
        c = self.config
        if self._prefill_scratch is None or self._prefill_scratch["residual"].shape[0] < rows:
            cp = self._cp
            widths = {"residual": (c.hidden_size, cp.float32), "normed": (c.hidden_size, cp.float16),
                      "delta": (c.hidden_size, cp.float32), "qkv": (self.layers[0].qkv.out_features, cp.float32),
                      "q": (c.q_dim, cp.float32), "attn": (c.q_dim, cp.float16),
                      "gate_up": (2 * c.intermediate_size, cp.float32), "hidden": (c.intermediate_size, cp.float16)}
            self._prefill_scratch = {name: cp.zeros((rows, width), dtype=dtype) for name, (width, dtype) in widths.items()}
        return {name: buffer[:rows] for name, buffer in self._prefill_scratch.items()}

    def _prefill_chunk(self, token_ids: np.ndarray, start_pos: int, last: bool) -> None:
        cp, k = self._cp, self.kernels
        t = len(token_ids)
        ids = cp.asarray(token_ids)
        self.prefill_start.set(np.array([start_pos], dtype=np.int32), stream=self.stream)
        b = self._prefill_buffers(t)
        residual, normed, delta, qkv, q, attn, gate_up, hidden = (
            b[name] for name in ("residual", "normed", "delta", "qkv", "q", "attn", "gate_up", "hidden"))

        k["embed_tokens"]((t,), (self.threads["embed_tokens"],), (ids, self.embed, residual))
        update = None  # layer 0 normalises the embedding as it is
        for i, layer in enumerate(self.layers):
            self._add_rmsnorm(residual, update, layer.input_norm, normed, t)
            qkv[...] = layer.qkv.bias32  # the GEMM adds onto the bias (beta = 1)
            self._gemm(normed, self._expand(layer.qkv), qkv, beta=1.0)
            self._rope_write_kv(qkv, self.prefill_start, i, q, t)
            self.attention.prefill(q, self._kv_layers[i], self.page_table, start_pos, t, attn)
            self._gemm(attn, self._expand(layer.o), delta, beta=0.0)
            self._add_rmsnorm(residual, delta, layer.post_norm, normed, t)
            self._gemm(normed, self._expand(layer.gate_up), gate_up, beta=0.0)
            blocks = self._elementwise_blocks(hidden.size)
            k["silu_mul_rows"]((blocks,), (ELEMENTWISE_THREADS,), (gate_up, hidden, np.int32(t)))
            self._gemm(hidden, self._expand(layer.down), delta, beta=0.0)
            update = delta
        if last:  # only the prompt's last token needs logits: finish its row alone
            self._add_rmsnorm(residual[t - 1], delta[t - 1], self.final_norm, self.normed, 1)
            self._lm_head(choose=False)

    def prefill(self, token_ids, start_pos: int, page_table) -> np.ndarray:
        """Write K/V of `token_ids` [T] at start_pos.. into the cache; logits [vocab] of the last."""
        token_ids = self._check_tokens(token_ids)
        pages = self._check_positions(start_pos, len(token_ids), page_table)
        self._device_holds = None
        with self.stream:
            self.page_table[: len(pages)].set(pages, stream=self.stream)
            for begin in range(0, len(token_ids), PREFILL_CHUNK):
                self._prefill_chunk(token_ids[begin : begin + PREFILL_CHUNK], start_pos + begin,
                                    last=begin + PREFILL_CHUNK >= len(token_ids))
            return self.logits.get(stream=self.stream)
