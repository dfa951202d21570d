"""The CUDA backend: the Qwen2 forward pass as a fixed sequence of kernel launches.

It implements the same protocol as `nanoqwen.reference.backend.NumpyBackend` (see
`nanoqwen.backends.Backend`) and, with fp16 activations, computes the same numbers
(ARCHITECTURE.md, "Numerics"; INT8 activations are chapter 8's approximation), with
the kernels in kernels/ compiled for this model by `nanoqwen.cuda.build`.

Decode, one token, every launch on `self.stream` (L = num_layers):

    embed_tokens                                   state.token -> residual (fp32)
    per layer:
      add_rmsnorm_cluster  residual += down of the layer before; normed = norm(residual)
      gemv_int4_qkv_rope   normed -> q (fp32, + bias, RoPE'd); K (RoPE'd), V (fp16) into the
                           cache at state.position                          split K in the block
      attention.decode     q, cache, page table, state.seq_len -> attn (fp16)
      gemv_int4_from_q_dim     attn -> o (fp32)                                split K in the block
      add_rmsnorm_cluster  residual += o; normed = norm(residual)
      gemv_int4_gate_up_silu   normed -> silu(gate) * up (fp16)
      gemv_int4_from_intermediate  -> down (fp32)                              split K in the block
    add_rmsnorm_cluster (final norm), lm_head_logits (+ per-block argmax of the sampler's keys),
    argmax_select_next (+ top-k and top-p, when the sampler has them)

(add_rmsnorm_cluster spreads the row over a cluster of RMS_CLUSTER blocks; prefill's
add_rmsnorm takes one block per row. With INT8 activations, or `rope_in_qkv` off, q|k|v is
the plain gemv_int4_from_hidden into a q|k|v buffer and rope_write_kv rotates and stores it.)

The class is assembled from its parts, one module each: weights (upload), step (buffers and one
step's launches), pipeline (steps fed back to back, tokens read from host memory), prefill
(cuBLAS); sampler (the device sampler's settings), plan (launch geometry), abi (the numbers the
kernels fix) and device (host memory and driver settings) serve them.
"""

from __future__ import annotations

import numpy as np

from ..config import PAGE_SIZE
from ..errors import BackendUnavailableError
from ..kvcache import kv_pool_shape, pages_needed
from ..loader import Model
from ..reference import ops
from . import abi, build
from .attention import check_config
from .device import fit_gemv_rings, set_carveout, sm_budget
from .launch import StepKernel
from .persistent import KERNEL as PERSISTENT_KERNEL, PersistentLayers, persistent_refusal
from .pipeline import TokenPipeline
from .plan import GEMV_CARVEOUT_PERCENT, QKV_ROPE_KERNEL, VERIFY_GEMVS, VERIFY_WIDTHS, block_threads
from .prefill import Prefill
from .step import DecodeStep
from .verify import VerifyPass
from .weights import PREFILL_WEIGHTS, WeightUpload

ACTIVATIONS = ("fp16", "int8")


def _default_attention():
    try:
        from .attention import PagedAttention
    except ModuleNotFoundError as e:
        if e.name != "nanoqwen.cuda.attention":
            raise
        raise RuntimeError(
            "nanoqwen.cuda.attention (the paged attention kernels) is not available, so the CUDA "
            "backend cannot run attention; pass attention_factory= to substitute one"
        ) from e
    return PagedAttention


class CudaBackend(WeightUpload, DecodeStep, TokenPipeline, Prefill, VerifyPass):
    name = "cuda"

    def __init__(self, model: Model, num_pages: int, attention_factory=None, use_graph: bool = True,
                 activations: str = "fp16", pdl: bool = True, prefill_weights: str = "auto", persistent: bool = False):
        """Upload `model`, compile the kernels for it and allocate a KV pool of `num_pages`.

        `attention_factory(config, num_pages, max_seq_len)` builds the attention object
        (default: nanoqwen.cuda.attention.PagedAttention). With `use_graph` (the default) decode
        replays one captured CUDA graph per token (nanoqwen.cuda.graph); without it, it launches
        every kernel from Python. `activations` picks the decode projections' input precision:
        "fp16" (Path B, the default) or "int8" (Path A of chapter 8: each projection's input is
        quantized to INT8 by a kernel of its own and multiplied with __dp4a; prefill is unchanged).
        With `pdl` (the default) the decode graph is captured with programmatic dependent launches
        (nanoqwen.cuda.launch), so each kernel may start while the one before it finishes; it
        changes nothing in eager launches, and falls back to plain launches, with a warning, where
        cuda.bindings is missing (`decode_graph().pdl` says which ran).

        With `persistent` a decode step runs every layer in one kernel launch (nanoqwen.cuda.persistent)
        instead of a kernel per operation, where the backend can (fp16 activations and the paged
        attention). The bits are the same; it is slower on Hopper today (chapter 13), so it is off by
        default. `self.persistent` says which form decodes, and may be switched.

        Prefill multiplies whole prompts with cuBLAS from fp16 matrices. `prefill_weights` says
        where they come from: "expand" dequantizes each projection into one scratch buffer every
        time a prompt needs it (memory: the largest projection); "cache" dequantizes all of them
        once, here, and keeps them (2 bytes per weight: 14 GB for the 7B), which takes the
        dequantization, about a fifth of a 512-token prefill, out of every prompt; "auto" (the
        default) caches when the device keeps PREFILL_CACHE_HEADROOM_BYTES free after it.
        `self.prefill_weights` says which was chosen.
        """
        import cupy as cp

        if not isinstance(num_pages, (int, np.integer)) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        device = cp.cuda.Device()
        if int(device.compute_capability) < 90:
            raise BackendUnavailableError(
                f"the CUDA backend needs a Hopper GPU (compute capability 9.0: the attention kernels use "
                f"cp.async.bulk and mbarrier transaction counts); GPU {device.id} has {device.compute_capability}"
            )
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        if prefill_weights not in PREFILL_WEIGHTS:
            raise ValueError(f"prefill_weights must be one of {', '.join(PREFILL_WEIGHTS)}, got {prefill_weights!r}")
        self._cp = cp
        self.activations = activations
        self.model = model
        self.config = c = model.config
        check_config(c)  # before the compile, whose static_asserts would say it less plainly
        self.num_pages = int(num_pages)
        self.max_seq_len = min(c.max_position_embeddings, self.num_pages * PAGE_SIZE)
        self.max_pages_per_seq = pages_needed(self.max_seq_len)
        self.num_sms = device.attributes["MultiProcessorCount"]
        self.sm = sm_budget(device)
        self.stream = cp.cuda.Stream(non_blocking=True)

        module = build.compile_module(c)
        abi.check_compiled(module, build.DECODER_KERNEL_FILES)
        self.kernels = {
            name: StepKernel(module.get_function(name), name)
            for name in (
                "embed_tokens", "add_rmsnorm", "add_rmsnorm_cluster", "gemv_int4_from_hidden", QKV_ROPE_KERNEL,
                "gemv_int4_from_q_dim",
                "gemv_int4_from_intermediate", "gemv_int4_gate_up_silu", "dequantize_int4_to_half",
                "rope_write_kv", "silu_mul_rows", "lm_head_logits", "argmax_select_next",
                *(f"{name}_{width}" for name in VERIFY_GEMVS for width in VERIFY_WIDTHS), "lm_head_logits_rows",
                "verify_select", PERSISTENT_KERNEL,
            )
        }
        self.gemv_ring_bytes = {}  # GEMV kernel -> one warp's ring
        for name, percent in GEMV_CARVEOUT_PERCENT.items():
            set_carveout(self.kernels[name], percent)
            self.gemv_ring_bytes[name] = fit_gemv_rings(self.kernels[name], module, name)
        self._init_verify(module)
        self.threads = block_threads(c)
        for name, threads in self.threads.items():
            if self.kernels[name].max_threads_per_block < threads:
                raise RuntimeError(f"kernel {name} cannot run {threads} threads per block on this GPU")

        with self.stream:
            self.layers = [self._upload_layer(model.layer(i)) for i in range(c.num_layers)]
            self.embed = cp.asarray(model.embed)  # fp16 [V, H]
            self.lm_head = self.embed if c.tie_word_embeddings else cp.asarray(model.lm_head)
            self.final_norm = cp.asarray(model.final_norm)
            self.inv_freq = cp.asarray(ops.rope_inv_freq(c.head_dim, c.rope_theta))  # fp32 [D/2]
            self.kv_pool = cp.zeros(kv_pool_shape(c, self.num_pages), dtype=cp.float16)
            self._kv_layers = [self.kv_pool[i] for i in range(c.num_layers)]
            self._allocate_decode_buffers()
            self.int8_layers = [self._int8_projections(i) for i in range(c.num_layers)] if activations == "int8" else None
        self.attention = (attention_factory or _default_attention())(c, self.num_pages, self.max_seq_len)
        self._reserve_verify_rows()
        self._persistent_layers = PersistentLayers(self, module) if persistent_refusal(self) is None else None
        self._weight_scratch = None  # fp16 expansion of one projection, made at the first prefill
        self._prefill_scratch = None  # prefill's activations, allocated at the first prefill (Prefill)
        self.prefill_weights = self._keep_dense_weights(prefill_weights)
        self.use_graph = use_graph
        self._graph = None  # captured at the first graph decode
        self.rope_in_qkv = activations == "fp16"
        self.pdl = pdl
        self.persistent = persistent and self._persistent_layers is not None
        self._device_holds = None  # (token, position, page table) the device state holds for the next step
        self._pending = None  # the page table of the step in flight
        self.host_draws = 0  # decode_next's steps whose token the host drew from the logits
        device.synchronize()  # uploads and attention's set-up may run on other streams
