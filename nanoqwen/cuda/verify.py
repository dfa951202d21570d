"""The verify pass of speculative decoding: one pass over the weights for several tokens.

Rows [token, *drafts] at consecutive positions go through decode's launch sequence with a token
dimension (kernels/verify.cu): the GEMVs read each INT4 weight once for all rows, attention
gives row r the cache up to its own position (paged_attention_decode's gridDim.z), and the last
kernel chooses every row's token, compares it with the next row's draft and advances the decode
state past the accepted ones. The host reads one small row of mapped memory: the count and the
tokens. One CUDA graph per row count is captured at its first use.

Each row is computed with decode's arithmetic in decode's order, so its token is the one a
decode step would choose there, greedy or sampled (tests/test_verify_cuda.py). A sampler with a
top-k or top-p leaves the choice to the host, from the rows' logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..sampling import GREEDY, SamplingParams
from ..speculative import MAX_DRAFTS, accepted_tokens
from . import build
from .abi import ARGMAX_THREADS, LM_HEAD_THREADS, VERIFY_ROWS
from .device import NULL, mapped_host_array, set_carveout
from .graph import capture
from .launch import programmatic_launches
from .plan import GEMV_CARVEOUT_PERCENT, VERIFY_GEMVS, VERIFY_WIDTHS, gemv_launch, verify_kernel, verify_splits
from .sampler import check_finite, device_top_k

VERDICT_HEAD = 2  # verify_select's verdict: accepted count, status, then the accepted tokens


class VerifyPass:
    """CudaBackend's part that runs verify passes (`verify`, the protocol's)."""

    def _init_verify(self, module) -> None:
        self.verify_rows = VERIFY_ROWS  # abi.check_compiled has compared the module's
        if self.verify_rows < MAX_DRAFTS + 1:
            raise RuntimeError(f"kernels/verify.cu takes {self.verify_rows} rows; speculation drafts up to "
                               f"{MAX_DRAFTS} + 1")
        # Each verify GEMV takes its decode twin's carve-out (its ring depth too, kernels/verify.cu).
        self._verify_ring_bytes = {}  # kernel -> one warp's ring
        for name, gemv in VERIFY_GEMVS.items():
            for width in VERIFY_WIDTHS:
                kernel = f"{name}_{width}"
                set_carveout(self.kernels[kernel], GEMV_CARVEOUT_PERCENT[gemv.decode_kernel])
                self._verify_ring_bytes[kernel] = build.module_int(module, f"{kernel}_ring_bytes")
                self.kernels[kernel].max_dynamic_shared_size_bytes = (verify_splits(name, self.config, self.num_sms, self.sm)
                                                                      * self._verify_ring_bytes[kernel])
        self._verify = None  # buffers, allocated at the first pass
        self._verify_graphs = {}  # rows -> graph

    def _reserve_verify_rows(self) -> None:
        """Let the attention decode the verify pass's rows. Its per-row buffers are allocated here,
        with the attention, before any graph is captured: a graph holds the addresses it was
        captured with, so a buffer replaced later would leave the decode graph writing freed memory."""
        reserve = getattr(self.attention, "reserve_rows", None)
        if reserve is not None:
            reserve(self.verify_rows)

    @property
    def verify_refusal(self) -> str | None:
        """Why this backend cannot verify (None: it can)."""
        if self.activations != "fp16":
            return "verify passes run decode's fp16 kernels, and this CUDA backend decodes with INT8 activations"
        if getattr(self.attention, "rows_reserved", 1) < self.verify_rows:
            return f"this backend's attention ({type(self.attention).__name__}) decodes one row at a time"
        return None

    def _allocate_verify_buffers(self) -> None:
        cp, c, rows = self._cp, self.config, self.verify_rows
        blocks = self.num_sms  # lm_head_logits_rows: one block per SM holds the rows' x
        verdict, verdict_memory = mapped_host_array((VERDICT_HEAD + rows,), np.int32)
        self._verify = {
            "tokens": cp.zeros(rows, dtype=cp.int32),
            "residual": cp.empty((rows, c.hidden_size), dtype=cp.float32),
            "normed": cp.empty((rows, c.hidden_size), dtype=cp.float16),
            "q": cp.empty((rows, c.q_dim), dtype=cp.float32),
            "attn": cp.empty((rows, c.q_dim), dtype=cp.float16),
            "o": cp.empty((rows, c.hidden_size), dtype=cp.float32),
            "hidden": cp.empty((rows, c.intermediate_size), dtype=cp.float16),
            "down": cp.empty((rows, c.hidden_size), dtype=cp.float32),
            "logits": cp.empty((rows, c.vocab_size), dtype=cp.float32),
            "candidate_values": cp.empty((rows, blocks), dtype=cp.float32),
            "candidate_indices": cp.empty((rows, blocks), dtype=cp.int32),
            "blocks": blocks, "verdict": verdict, "verdict_memory": verdict_memory,
        }
        self.kernels["lm_head_logits_rows"].max_dynamic_shared_size_bytes = rows * c.hidden_size * 2

    def _verify_gemv(self, name: str, linear, tokens: int, args) -> None:
        # gate+up's blocks take a tile of gate's rows and the same rows of up; every row's sums are
        # added in decode's order because the pass takes the split decode launches `linear` with
        rows = self.config.intermediate_size if name == "gemv_int4_gate_up_silu_rows" else linear.out_features
        kernel = verify_kernel(name, tokens)
        grid, block, shared = gemv_launch(VERIFY_GEMVS[name].decode_kernel, rows, linear.splits,
                                          self._verify_ring_bytes[kernel])
        self.kernels[kernel](grid, block, (*args, np.int32(tokens)), shared_mem=shared)

    def verify_launches(self, tokens: int, stream) -> None:
        """Issue one verify pass of `tokens` rows (the inputs in `_verify["tokens"]` and `state`):
        like decode_step_launches, no allocation and fixed arguments, the sequence a graph captures."""
        k, v = self.kernels, self._verify
        residual, normed, q, attn = v["residual"][:tokens], v["normed"][:tokens], v["q"][:tokens], v["attn"][:tokens]
        o, hidden, down_out = v["o"][:tokens], v["hidden"][:tokens], v["down"][:tokens]
        with stream:
            k["embed_tokens"]((tokens,), (self.threads["embed_tokens"],), (v["tokens"], self.embed, residual))
            down = None
            for i, layer in enumerate(self.layers):
                self._add_rmsnorm(residual, down, layer.input_norm, normed, tokens, cluster=True)
                qkv = layer.qkv
                self._verify_gemv("gemv_int4_qkv_rope_rows", qkv, tokens,
                                  (qkv.qweight, qkv.scales, NULL if qkv.bias is None else qkv.bias, normed,
                                   self.position, self.inv_freq, self.page_table, self._kv_layers[i], q))
                self.attention.decode(q, self._kv_layers[i], self.page_table, self.seq_len, attn, stream=stream,
                                      rows=tokens)
                self._verify_gemv("gemv_int4_rows_from_q_dim", layer.o, tokens,
                                  (layer.o.qweight, layer.o.scales, NULL if layer.o.bias is None else layer.o.bias,
                                   attn, o, np.int32(layer.o.out_features)))
                self._add_rmsnorm(residual, o, layer.post_norm, normed, tokens, cluster=True)
                self._verify_gemv("gemv_int4_gate_up_silu_rows", layer.gate_up, tokens,
                                  (layer.gate_up.qweight, layer.gate_up.scales, normed, hidden))
                self._verify_gemv("gemv_int4_rows_from_intermediate", layer.down, tokens,
                                  (layer.down.qweight, layer.down.scales,
                                   NULL if layer.down.bias is None else layer.down.bias, hidden, down_out,
                                   np.int32(layer.down.out_features)))
                down = down_out
            self._add_rmsnorm(residual, down, self.final_norm, normed, tokens, cluster=True)
            k["lm_head_logits_rows"](
                (v["blocks"],), (LM_HEAD_THREADS,),
                (normed, self.lm_head, v["logits"], v["candidate_values"], v["candidate_indices"], self.state,
                 self.sampler, np.int32(tokens)),
                shared_mem=tokens * self.config.hidden_size * 2,
            )
            k["verify_select"](
                (1,), (ARGMAX_THREADS,),
                (v["candidate_values"], v["candidate_indices"], np.int32(v["blocks"]), np.int32(tokens), v["tokens"],
                 self.state, np.uint64(v["verdict"].ctypes.data)),
            )

    def _verify_graph(self, tokens: int):
        graph = self._verify_graphs.get(tokens)
        if graph is None:
            with programmatic_launches(self.pdl):
                graph = capture(self.stream, lambda: self.verify_launches(tokens, self.stream))
            self._verify_graphs[tokens] = graph
        return graph

    def verify(self, token_id: int, drafts: Sequence[int], position: int, page_table,
               sampling: SamplingParams = GREEDY) -> list[int]:
        """One pass over the weights for rows [token_id, *drafts] at position.. (see
        nanoqwen.backends.Backend.verify); the device chooses and compares, and the host reads
        back the accepted tokens. Greedy and temperature sampling choose on the device; a top-k
        or top-p, on the host from the rows' logits."""
        if self.verify_refusal:
            raise ValueError(self.verify_refusal)
        drafts = list(drafts)
        if len(drafts) > MAX_DRAFTS:
            raise ValueError(f"a verify pass takes at most {MAX_DRAFTS} drafts, got {len(drafts)}")
        rows = self._check_tokens(np.array([token_id, *drafts]))
        tokens = len(rows)
        pages = self._check_positions(position, tokens, page_table)
        if self._verify is None:
            self._allocate_verify_buffers()
        device_chooses = device_top_k(sampling, self.config.vocab_size) == 0
        self.set_sampler(sampling if device_chooses else GREEDY)
        self._upload_step_inputs(int(rows[0]), position, pages)
        self._device_holds = None  # the pass advances the state by a count the host learns below
        verdict = self._verify["verdict"]
        verdict[0] = -1
        self._verify["tokens"][:tokens].set(rows.astype(np.int32), stream=self.stream)
        if self.use_graph:
            self._verify_graph(tokens).launch(self.stream)
        else:
            self.verify_launches(tokens, self.stream)
        self.stream.synchronize()
        if not device_chooses:
            logits = self._verify["logits"][:tokens].get(stream=self.stream)
            return accepted_tokens(logits, drafts, sampling, position)
        accepted, status = int(verdict[0]), int(verdict[1])
        if not 1 <= accepted <= tokens:
            raise RuntimeError(f"the verify pass left no verdict (accepted = {accepted})")
        check_finite(status)
        return [int(t) for t in verdict[VERDICT_HEAD : VERDICT_HEAD + accepted]]

    def verify_logits(self, token_id: int, drafts: Sequence[int], position: int, page_table) -> np.ndarray:
        """The logits [len(drafts) + 1, vocab] of a verify pass's rows (greedy choice on the device
        is run and ignored), as NumpyBackend.verify_logits gives them."""
        self.verify(token_id, drafts, position, page_table, GREEDY)
        return self._verify["logits"][: len(drafts) + 1].get(stream=self.stream)
