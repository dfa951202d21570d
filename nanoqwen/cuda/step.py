"""One decode step as a fixed sequence of launches over buffers allocated once.

Every buffer is allocated before the first step; the per-step values (token, position, sequence
length, page table) live in one device int32 array, `state` (kernels/common.cuh), which the host
sets with one copy and argmax_select_next advances. So a step allocates nothing, waits for
nothing and passes the same arguments every time: one CUDA graph captures it and serves every
token (nanoqwen.cuda.graph).
"""

from __future__ import annotations

import numpy as np

from ..sampling import GREEDY
from .abi import (
    ARGMAX_THREADS,
    ELEMENTWISE_THREADS,
    LM_HEAD_THREADS,
    RMS_CLUSTER,
    STATE_PAGE_TABLE,
    STATE_POSITION,
    STATE_SEQ_LEN,
    STATE_TOKEN,
)
from .device import NULL, mapped_host_array, persistent_blocks
from .plan import GEMV_KERNELS, QKV_ROPE_KERNEL, gemv_launch
from .sampler import sampler_settings
from .weights import DeviceLinear

# Rows of host memory that argmax_select_next writes each step's state head to (row = position %
# rows): next_tokens reads one step's row while the next step, queued behind it, writes the other.
HEAD_SLOTS = 2


class GraphOption:
    """A switch of the decode step's form: setting it to a new value drops the captured graph, which
    is captured again, the other way, at the next graph decode. `allowed(backend, value)` says
    whether this backend can take the value; if not, ValueError(refusal)."""

    def __init__(self, doc: str, allowed=None, refusal: str = ""):
        self.__doc__, self.allowed, self.refusal = doc, allowed, refusal

    def __set_name__(self, owner, name: str) -> None:
        self.attribute = "_" + name

    def __get__(self, backend, owner=None):
        return self if backend is None else getattr(backend, self.attribute)

    def __set__(self, backend, enabled) -> None:
        enabled = bool(enabled)
        if self.allowed is not None and not self.allowed(backend, enabled):
            raise ValueError(self.refusal)
        if getattr(backend, self.attribute, None) != enabled:
            setattr(backend, self.attribute, enabled)
            backend._graph = None
            backend._verify_graphs = {}


class DecodeStep:
    """CudaBackend's part that allocates the decode buffers and issues one step's launches."""

    def _allocate_decode_buffers(self) -> None:
        cp, c = self._cp, self.config
        first = self.layers[0]
        self.state = cp.zeros(STATE_PAGE_TABLE + self.max_pages_per_seq, dtype=cp.int32)
        self.token = self.state[STATE_TOKEN : STATE_TOKEN + 1]
        self.position = self.state[STATE_POSITION : STATE_POSITION + 1]
        self.seq_len = self.state[STATE_SEQ_LEN : STATE_SEQ_LEN + 1]
        self.page_table = self.state[STATE_PAGE_TABLE:]
        # Each step's new state head, written by argmax_select_next into host memory (mapped, so the
        # kernel stores to it directly): next_tokens reads the tokens from here.
        self.head_slots, self._head_slots_memory = mapped_host_array((HEAD_SLOTS, STATE_PAGE_TABLE), np.int32)
        self.head_slots[:] = -1
        self.head_slots_address = np.uint64(self.head_slots.ctypes.data)  # the kernel's pointer to them
        self.residual = cp.empty(c.hidden_size, dtype=cp.float32)
        self.normed = cp.empty(c.hidden_size, dtype=cp.float16)
        self.qkv_out = cp.empty(first.qkv.out_features, dtype=cp.float32)
        self.q = cp.empty(c.q_dim, dtype=cp.float32)
        self.attn_out = cp.empty(c.q_dim, dtype=cp.float16)
        self.o_out = cp.empty(c.hidden_size, dtype=cp.float32)
        self.mlp_hidden = cp.empty(c.intermediate_size, dtype=cp.float16)
        self.gate_up_out = cp.empty(2 * c.intermediate_size, dtype=cp.float32) if self.activations == "int8" else None
        self.down_out = cp.empty(c.hidden_size, dtype=cp.float32)
        self.logits = cp.empty(c.vocab_size, dtype=cp.float32)
        # A step that leaves its draw to the host copies its logits to row position % HEAD_SLOTS.
        self.handed_back = cp.empty((HEAD_SLOTS, c.vocab_size), dtype=cp.float32)
        self.lm_head_blocks = persistent_blocks(self.kernels["lm_head_logits"], LM_HEAD_THREADS, self.num_sms)
        self.candidate_values = cp.empty(self.lm_head_blocks, dtype=cp.float32)
        self.candidate_indices = cp.empty(self.lm_head_blocks, dtype=cp.int32)
        self._sampler_holds = sampler_settings(GREEDY, c.vocab_size)  # greedy until a request says otherwise
        self.sampler = cp.asarray(self._sampler_holds)
        self.prefill_start = cp.zeros(1, dtype=cp.int32)

    def _add_rmsnorm(self, residual, delta, weight, out, rows: int, cluster: bool = False) -> None:
        """residual += delta (None: nothing to add); out = norm(residual), for `rows` rows: one block
        per row, or with `cluster` (decode) each row over a cluster of RMS_CLUSTER blocks."""
        kernel, blocks_per_row = ("add_rmsnorm_cluster", RMS_CLUSTER) if cluster else ("add_rmsnorm", 1)
        self.kernels[kernel](
            (rows * blocks_per_row,), (self.threads[kernel],), (residual, NULL if delta is None else delta, weight, out),
        )

    def _gemv(self, kernel: str, linear: DeviceLinear, x, y) -> None:
        grid, block, shared_mem = gemv_launch(kernel, linear.out_features, linear.splits, self.gemv_ring_bytes[kernel])
        self.kernels[kernel](
            grid, block,
            (linear.qweight, linear.scales, NULL if linear.bias is None else linear.bias, x, y,
             np.int32(linear.out_features)),
            shared_mem=shared_mem,
        )

    def _rope_write_kv(self, qkv, positions_base, layer: int, q_out, num_tokens: int) -> None:
        c = self.config
        self.kernels["rope_write_kv"](
            (num_tokens, c.num_heads + c.num_kv_heads), (self.threads["rope_write_kv"],),
            (qkv, positions_base, self.inv_freq, self.page_table, self._kv_layers[layer], q_out),
        )

    def _qkv_rope(self, layer: int) -> None:
        """Decode's q|k|v of `normed`, RoPE'd: q into `q`, K and V into the layer's cache at the
        step's position (gemv_int4_qkv_rope)."""
        linear = self.layers[layer].qkv
        grid, block, shared_mem = gemv_launch(QKV_ROPE_KERNEL, linear.out_features, linear.splits,
                                              self.gemv_ring_bytes[QKV_ROPE_KERNEL])
        self.kernels[QKV_ROPE_KERNEL](
            grid, block,
            (linear.qweight, linear.scales, NULL if linear.bias is None else linear.bias, self.normed, self.position,
             self.inv_freq, self.page_table, self._kv_layers[layer], self.q),
            shared_mem=shared_mem,
        )

    def _lm_head(self, choose: bool) -> None:
        """The logits of `normed`; with `choose` (decode) also the candidates for the next token
        under `sampler`; prefill's last token is chosen on the host from its logits."""
        self.kernels["lm_head_logits"](
            (self.lm_head_blocks,), (LM_HEAD_THREADS,),
            (self.normed, self.lm_head, self.logits, self.candidate_values, self.candidate_indices,
             *((self.state, self.sampler) if choose else (NULL, NULL))),
        )

    def _elementwise_blocks(self, n: int) -> int:
        """Grid of a grid-stride elementwise kernel over n items: enough blocks to fill the GPU."""
        return min(-(-n // ELEMENTWISE_THREADS), self.num_sms * 8)

    def _project(self, layer: int, name: str, x, y) -> None:
        """One decode projection of x into y, fp32: Path B's split-K GEMV or Path A's."""
        if self.int8_layers is None:
            self._gemv(GEMV_KERNELS[name], getattr(self.layers[layer], name), x, y)
        else:
            self.int8_layers[layer][name](x, y)

    def _mlp_hidden(self, layer: int) -> None:
        """silu(gate) * up of the normalised residual, fp16, into mlp_hidden."""
        c, w = self.config, self.layers[layer]
        if self.int8_layers is None:  # Path B fuses SwiGLU into the gate+up GEMV
            grid, block, shared_mem = gemv_launch("gemv_int4_gate_up_silu", c.intermediate_size, w.gate_up.splits,
                                                 self.gemv_ring_bytes["gemv_int4_gate_up_silu"])
            self.kernels["gemv_int4_gate_up_silu"](
                grid, block, (w.gate_up.qweight, w.gate_up.scales, self.normed, self.mlp_hidden), shared_mem=shared_mem,
            )
            return
        self.int8_layers[layer]["gate_up"](self.normed, self.gate_up_out)
        self.kernels["silu_mul_rows"]((self._elementwise_blocks(c.intermediate_size),), (ELEMENTWISE_THREADS,), (self.gate_up_out, self.mlp_hidden, np.int32(1)))

    @property
    def launches_per_token(self) -> int:
        """Kernel launches of one decode step, counting each attention.decode call as the
        number of launches it reports (`launches_per_decode`, default 1)."""
        if self.persistent:
            return 4  # embed_tokens, decode_layers_persistent, lm_head_logits, argmax_select_next
        attention = getattr(self.attention, "launches_per_decode", 1)
        # Path B: norm, q|k|v (+ RoPE unless rope_in_qkv is off), o, norm, gate+up, down; Path A
        # adds a quantize launch per projection and SwiGLU apart
        per_layer = (6 if self.rope_in_qkv else 7) if self.activations == "fp16" else 12
        return 1 + self.config.num_layers * (per_layer + attention) + 3

    def decode_step_launches(self, stream) -> int:
        """Issue one decode step on `stream` from the inputs in `state`; returns the launch count.

        No allocation, no synchronisation, arguments identical on every call: the sequence a
        CUDA graph captures. Afterwards `logits` holds the step's logits and `state` the token that
        `sampler` chose and the advanced position.
        """
        k = self.kernels
        with stream:
            k["embed_tokens"]((1,), (self.threads["embed_tokens"],), (self.token, self.embed, self.residual))
            if self.persistent:
                self._persistent_layers.launch()  # every layer and the final norm
            else:
                self._layer_launches(stream)
            self._lm_head(choose=True)
            k["argmax_select_next"](
                (1,), (ARGMAX_THREADS,),
                (self.candidate_values, self.candidate_indices, np.int32(self.lm_head_blocks), self.state,
                 self.head_slots_address, np.int32(HEAD_SLOTS), self.logits, self.sampler, self.handed_back),
            )
        return self.launches_per_token

    def _layer_launches(self, stream) -> None:
        """The layers and the final norm, a kernel per operation: residual (the embedding) in, normed out."""
        with stream:
            down = None  # layer 0 normalises the embedding as it is
            for i, layer in enumerate(self.layers):
                self._add_rmsnorm(self.residual, down, layer.input_norm, self.normed, 1, cluster=True)
                if self.rope_in_qkv:
                    self._qkv_rope(i)
                else:
                    self._project(i, "qkv", self.normed, self.qkv_out)
                    self._rope_write_kv(self.qkv_out, self.position, i, self.q, 1)
                self.attention.decode(self.q, self._kv_layers[i], self.page_table, self.seq_len, self.attn_out,
                                      stream=stream)
                self._project(i, "o", self.attn_out, self.o_out)
                self._add_rmsnorm(self.residual, self.o_out, layer.post_norm, self.normed, 1, cluster=True)
                self._mlp_hidden(i)
                self._project(i, "down", self.mlp_hidden, self.down_out)
                down = self.down_out
            self._add_rmsnorm(self.residual, down, self.final_norm, self.normed, 1, cluster=True)

    def decode_graph(self):
        """The decode step as a CUDA graph, captured on first use (nanoqwen.cuda.graph)."""
        if self._graph is None:
            from .graph import DecodeGraph

            self._graph = DecodeGraph(self, pdl=self._pdl)
        return self._graph

    pdl = GraphOption(
        "Whether the decode graph is to be captured with programmatic dependent launches.")

    persistent = GraphOption(
        "Whether a decode step runs its layers in one persistent kernel (nanoqwen.cuda.persistent) instead of a "
        "kernel per operation; both compute the same bits.",
        allowed=lambda backend, enabled: not enabled or backend._persistent_layers is not None,
        refusal="this backend cannot decode with the persistent kernel (INT8 activations, or a substitute attention)")

    rope_in_qkv = GraphOption(
        "Whether decode's q|k|v GEMV rotates its rows and writes the cache itself (gemv_int4_qkv_rope, "
        "the fp16 default); off, rope_write_kv does that after the plain GEMV, as with INT8 "
        "activations, which only have that form. Both write the same bits (tests/test_kernels_cuda.py).",
        allowed=lambda backend, enabled: not enabled or backend.activations == "fp16",
        refusal="rope_in_qkv needs fp16 activations: the INT8 path quantizes x for its own q|k|v GEMV")
