"""The CUDA backend: the Qwen2 forward pass as a fixed sequence of kernel launches.

It implements the same protocol as `nanoqwen.reference.backend.NumpyBackend` (see
`nanoqwen.engine.Backend`) and, with fp16 activations, computes the same numbers
(ARCHITECTURE.md, "Numerics"; INT8 activations are chapter 7's approximation), with
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

Every buffer is allocated in `__init__`; the per-step values (token, position, sequence length,
page table) live in one device int32 array, `state`, which the host sets with one copy and
which argmax_select_next advances. So a decode step allocates nothing, waits for nothing and
passes the same arguments every time: one CUDA graph can capture it and serve every token.
argmax_select_next also stores each step's new state head in mapped host memory (`head_slots`),
where the host reads the chosen tokens without a copy in the stream. The device chooses greedy and
sampled tokens (the sampler's settings are one more device array, `sampler`), except a top-k above
TOP_K_MAX, and the steps of a top-p alone whose run is longer than the TOP_K_MAX tokens the device
keeps (`may_hand_back`): those bring the logits to the host (nanoqwen.sampling), from a copy
(`handed_back`) that the step queued behind them does not overwrite.

Prefill runs whole prompts through cuBLAS: each INT4 matrix is expanded into an fp16 scratch
buffer and multiplied with fp16 activations, accumulating in fp32 (cublasGemmEx). The only
numerical difference from the contract is that expansion's fp16 rounding of each weight
(relative error <= 2^-11, documented in kernels/gemv_int4.cu).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import build as cuda_build
from ..reference import ops as ops_numpy
from ..config import PAGE_SIZE
from .launch import StepKernel
from ..engine import PREFILL_WEIGHTS
from ..kvcache import check_positions, check_tokens, kv_pool_shape, pages_needed
from ..loader import Int4Linear, Model
from ..quant import TILE_ROWS, tile_int4
from ..sampling import GREEDY, SamplingParams, sample

# Offsets into `state` (kernels/common.cuh).
STATE_TOKEN, STATE_POSITION, STATE_SEQ_LEN, STATE_STATUS, STATE_PAGE_TABLE = 0, 1, 2, 3, 4
STATUS_NOT_FINITE, STATUS_HOST_DRAWS = 1, 2  # values of state[STATE_STATUS] besides 0
GEMV_MAX_SPLITS = 16  # warps of a split-K GEMV block (kernels/gemv_int4.cu SPLIT_K_MAX_WARPS)
GATE_UP_MAX_SPLITS = 4  # warps of a gate+up block (kernels/gemv_int4.cu GATE_UP_MAX_SPLITS)
# Warps per 16-row tile of the gate+up GEMV, each a share of the input groups.
GATE_UP_SPLITS = 2
LM_HEAD_THREADS = 256
ARGMAX_THREADS = 1024
TOP_K_MAX = ARGMAX_THREADS  # the largest top-k argmax_select_next applies (kernels/lm_head.cu)
ELEMENTWISE_THREADS = 256
RMS_CLUSTER = 8  # blocks of add_rmsnorm_cluster's clusters (kernels/rmsnorm.cu)
# Split K so that each SM gets about this many GEMV warps (each keeps 7 groups, 7 KB, of weights
# in flight). Isolated, 12 was fastest for down_proj on an H200 (results/kernels-h200.md); in the
# decode step, where each GEMV fills its rings while the kernel before it runs, 16 was: 2.030
# ms/token against 2.074 (12), 2.147 (20) and 2.427 (8) (results/gemv-lab-h200.md, session 4).
# The engine splits down_proj by it; q|k|v and o by CHAIN_GEMV_GROUPS_PER_SPLIT (projection_splits).
GEMV_WARPS_PER_SM = 16
# Each GEMV's preferred shared-memory carve-out, in percent of each SM's capacity (-1 leaves the
# driver's choice). With its ring depth (kernels/gemv_int4.cu, NQ_*_STAGES) it sets how many of the
# kernel's blocks an SM holds, and so where they land when they start early, beside the kernel
# before them. q|k|v and o hold three blocks per SM at half the capacity, which made the step 11-14
# us faster than the full one (results/gemv-warps-carveout-sweep-h200.json, 2026-11-29). down_proj,
# with 6-deep rings, holds two at the full capacity, the configuration gate+up (the kernel before
# it, at the driver's choice) runs in: 44-52 us faster than 4-deep rings at half, and 68-74 us
# faster than the same two blocks per SM in a 196 KB configuration, most likely because an SM can
# change its split of L1 and shared memory only when it is empty (results/step-lab-session8-h200.md,
# 2026-12-01).
GEMV_CARVEOUT_PERCENT = {"gemv_int4_from_hidden": 50, "gemv_int4_qkv_rope": 50, "gemv_int4_from_q_dim": 50,
                         "gemv_int4_from_intermediate": 100, "gemv_int4_gate_up_silu": -1}
MIN_GROUPS_PER_SPLIT = 4  # shorter splits leave most of a warp's copy ring (4-6 groups) idle
# q|k|v and o sit on the step's chain of small kernels (chapter 9), where what a warp still has to
# multiply after its wait is the kernel's time. So they split K until no warp has more than this
# many groups: ten warps per tile at the 7B's 28 groups. Each warp's range then fits its 3-deep ring
# (NQ_FROM_HIDDEN_STAGES, NQ_FROM_Q_DIM_STAGES) and is requested whole before the wait, and three
# blocks' rings (3 x 38 KB) fit an SM at half the carve-out, so q|k|v's 288 tiles start in one wave.
# On an H200: 1.559-1.561 ms per step against 1.576-1.582 at seven warps per tile with 4-deep rings;
# nine or eight warps, or fourteen for o, were slower (results/step-lab-session13-h200.md).
CHAIN_GEMV_GROUPS_PER_SPLIT = {"qkv": 3, "o": 3}
PREFILL_CHUNK = 1024  # tokens per prefill pass: bounds the [T, 2 I] fp32 MLP buffer
# Rows of host memory that argmax_select_next writes each step's state head to (row = position %
# rows): next_tokens reads one step's row while the next step, queued behind it, writes the other.
HEAD_SLOTS = 2
NULL = np.uint64(0)  # a null pointer kernel argument
ACTIVATIONS = ("fp16", "int8")
# "auto" keeps fp16 copies of the projections for prefill when this much device memory stays free
# after them (prefill's activations for a PREFILL_CHUNK of the 7B take ~0.3 GB).
PREFILL_CACHE_HEADROOM_BYTES = 2 * 2**30
GEMV_KERNELS = {"qkv": "gemv_int4_from_hidden", "o": "gemv_int4_from_q_dim", "down": "gemv_int4_from_intermediate"}
# Decode's fp16 q|k|v: gemv_int4_from_hidden's work with RoPE and the cache write in its epilogue.
QKV_ROPE_KERNEL = "gemv_int4_qkv_rope"
# GEMV kernel -> the macro of kernels/gemv_int4.cu that sets its ring depth (tools/sweep_gemv_stages.py sets them)
GEMV_STAGES_MACROS = {"gemv_int4_from_hidden": "NQ_FROM_HIDDEN_STAGES", QKV_ROPE_KERNEL: "NQ_FROM_HIDDEN_STAGES",
                      "gemv_int4_from_q_dim": "NQ_FROM_Q_DIM_STAGES",
                      "gemv_int4_from_intermediate": "NQ_FROM_INTERMEDIATE_STAGES",
                      "gemv_int4_gate_up_silu": "NQ_GATE_UP_STAGES"}
# GEMV kernel -> the most warps (splits) a block holds; each warp has a ring of shared memory, whose
# size the module's `__device__ int <kernel>_ring_bytes` holds.
GEMV_MAX_WARPS = {**{name: GEMV_MAX_SPLITS for name in (*GEMV_KERNELS.values(), QKV_ROPE_KERNEL)},
                  "gemv_int4_gate_up_silu": GATE_UP_MAX_SPLITS}
CUDA_R_16F, CUDA_R_32F = 2, 0  # cudaDataType values


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


def block_threads(config) -> dict[str, int]:
    """Threads per block of the kernels whose block size is fixed by their __launch_bounds__."""
    cluster_vectors = config.hidden_size // 4 // RMS_CLUSTER
    return {
        "add_rmsnorm": min(config.hidden_size // 4, 1024),  # one float4 per thread (rmsnorm.cu)
        "add_rmsnorm_cluster": min(-(-cluster_vectors // 32) * 32, 1024),  # a block's share of the row, whole warps
        "embed_tokens": min(config.hidden_size // 8, 1024),  # one 16-byte piece per thread
        "rope_write_kv": config.head_dim // 2,  # one rotation pair per thread
        "lm_head_logits": LM_HEAD_THREADS,
        "argmax_select_next": ARGMAX_THREADS,
    }


def gemv_splits(out_features: int, in_features: int, num_sms: int, group_size: int = 128,
                warps_per_sm: int = GEMV_WARPS_PER_SM, min_groups_per_split: int = MIN_GROUPS_PER_SPLIT) -> int:
    """Split-K factor for a decode GEMV: about `warps_per_sm` (tile, split) warps per SM, while
    each split keeps at least `min_groups_per_split` groups and a tile's splits fit one block."""
    tiles = -(-out_features // TILE_ROWS)
    groups = in_features // group_size
    wanted = -(-warps_per_sm * num_sms // tiles)
    return max(1, min(wanted, groups // min_groups_per_split, GEMV_MAX_SPLITS))


def projection_splits(projection: str, out_features: int, in_features: int, num_sms: int, group_size: int = 128) -> int:
    """The split-K factor the engine gives a decode projection ("qkv", "o", "down", "gate_up"; the
    fused gate+up GEMV itself runs GATE_UP_SPLITS warps per tile): the chain GEMVs at most
    CHAIN_GEMV_GROUPS_PER_SPLIT groups per warp, the others `gemv_splits`' warps per SM."""
    most_groups = CHAIN_GEMV_GROUPS_PER_SPLIT.get(projection)
    if most_groups is None:
        return gemv_splits(out_features, in_features, num_sms, group_size)
    return max(1, min(-(-(in_features // group_size) // most_groups), GEMV_MAX_SPLITS))


def gemv_launch(kernel: str, rows: int, splits: int, ring_bytes: int) -> tuple[tuple[int], tuple[int], int]:
    """(grid, block, dynamic shared bytes) of a GEMV of GEMV_MAX_WARPS: one block per 16-row tile of its
    `rows` output rows (gate+up: gate's, each block taking up's same rows too), `splits` warps in
    it, each with a ring of `ring_bytes` (fit_gemv_rings)."""
    most = GEMV_MAX_WARPS[kernel]
    if not 1 <= splits <= most:
        raise ValueError(f"a {kernel} block holds 1..{most} splits, got {splits}")
    return (-(-rows // TILE_ROWS),), (splits * 32,), splits * ring_bytes


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


def token_of_head(head: np.ndarray) -> int | None:
    """The token in the head of the decode state (token, position, seq_len, status); None when the
    device left the draw to the host (STATUS_HOST_DRAWS); FloatingPointError when the device's
    argmax flagged the logits, as numpy's choice does."""
    if head[STATE_STATUS] == STATUS_NOT_FINITE:
        raise FloatingPointError("logits are not finite (the device's argmax saw NaN or +inf, or only -inf)")
    if head[STATE_STATUS] == STATUS_HOST_DRAWS:
        return None
    return int(head[STATE_TOKEN])


def applied_top_k(sampling: SamplingParams, vocab_size: int) -> int:
    """The top-k that nanoqwen.sampling.sample applies (0: none; it ignores a k >= the vocabulary)."""
    return sampling.top_k if 0 < sampling.top_k < vocab_size else 0


def device_top_k(sampling: SamplingParams, vocab_size: int) -> int | None:
    """The top-k that the device applies for `sampling` (0: none), or None when the host must
    choose: a top-k above TOP_K_MAX. A top-p alone weighs every token; the device then keeps the
    TOP_K_MAX most likely, in which a peaked distribution's run ends (`may_hand_back` says when
    it may not)."""
    top_k = applied_top_k(sampling, vocab_size)
    if top_k == 0:
        return 0 if sampling.top_p == 1 else min(TOP_K_MAX, vocab_size)
    return top_k if top_k <= TOP_K_MAX else None


def nucleus_of_all(sampling: SamplingParams, vocab_size: int) -> bool:
    """Whether `sampling`'s top-p weighs every token (no top-k applies)."""
    return not sampling.greedy and sampling.top_p < 1 and applied_top_k(sampling, vocab_size) == 0


def may_hand_back(sampling: SamplingParams, vocab_size: int) -> bool:
    """Whether a step may leave its draw to the host (STATUS_HOST_DRAWS): a top-p alone over more
    tokens than the device keeps, whose run can be longer than those on a flat distribution."""
    return nucleus_of_all(sampling, vocab_size) and vocab_size > TOP_K_MAX


def sampler_settings(sampling: SamplingParams, vocab_size: int) -> np.ndarray:
    """kernels/lm_head.cu's SamplerSettings for `sampling`, as uint32 [8]: key0, key1, the
    temperature's float64 bits, top_k, nucleus_of_all, top_p's float64 bits (all zero: greedy)."""
    settings = np.zeros(8, dtype=np.uint32)
    if not sampling.greedy:
        top_k = device_top_k(sampling, vocab_size)
        if top_k is None:
            raise ValueError(f"{sampling} is drawn on the host (device_top_k)")
        settings[:2] = sampling.key
        settings[2:4].view(np.float64)[0] = sampling.temperature
        settings[4] = top_k
        settings[5] = nucleus_of_all(sampling, vocab_size)
        settings[6:8].view(np.float64)[0] = sampling.top_p
    return settings


def mapped_host_array(shape, dtype) -> tuple[np.ndarray, object]:
    """A numpy array in pinned host memory that kernels can write directly (mapped, zero-copy: with
    unified addressing, which every 64-bit CUDA platform has, its host address is also its device
    address). Returns (array, memory); the array is valid while `memory` is alive."""
    import ctypes

    import cupy as cp

    runtime = cp.cuda.runtime
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    memory = cp.cuda.PinnedMemory(nbytes, runtime.hostAllocMapped | runtime.hostAllocPortable)
    array = np.frombuffer((ctypes.c_byte * nbytes).from_address(memory.ptr), dtype=dtype).reshape(shape)
    return array, memory


def fit_gemv_rings(kernel, module, name: str) -> int:
    """Let GEMV `kernel` (`module`'s `name`) take the dynamic shared memory of its largest block,
    one ring per warp; returns one warp's ring bytes, which gemv_launch takes."""
    ring_bytes = cuda_build.module_int(module, f"{name}_ring_bytes")
    kernel.max_dynamic_shared_size_bytes = GEMV_MAX_WARPS[name] * ring_bytes
    return ring_bytes


def planned_ring_bytes(name: str, stages: int, group_size: int) -> int:
    """One warp's ring of GEMV `name` as kernels/gemv_int4.cu's GemvRing lays it out: per slot, the
    warp's tiles' (gate+up: two) 16 rows x group_size / 2 bytes of weights and group_size fp16 of x.
    The engine launches with the device's own figure (fit_gemv_rings); this plans without a GPU."""
    tiles = 2 if name == "gemv_int4_gate_up_silu" else 1
    return stages * (tiles * TILE_ROWS * group_size // 2 + 2 * group_size)


def set_carveout(kernel, percent: int) -> None:
    """Ask the driver to split each SM's L1/shared capacity so that `percent` of it is shared
    memory whenever `kernel` runs (-1: the driver's choice)."""
    import cupy as cp

    cp.cuda.driver.funcSetAttribute(kernel.kernel.ptr, cp.cuda.driver.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                    percent)


def persistent_blocks(kernel, threads: int, num_sms: int) -> int:
    """Blocks of a persistent kernel: as many as can be resident on the GPU at once."""
    import cupy as cp

    per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, threads, 0)
    return max(1, per_sm) * num_sms


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


class CudaBackend:
    name = "cuda"

    def __init__(self, model: Model, num_pages: int, attention_factory=None, use_graph: bool = True,
                 activations: str = "fp16", pdl: bool = True, prefill_weights: str = "auto"):
        """Upload `model`, compile the kernels for it and allocate a KV pool of `num_pages`.

        `attention_factory(config, num_pages, max_seq_len)` builds the attention object
        (default: nanoqwen.cuda.attention.PagedAttention). With `use_graph` (the default) decode
        replays one captured CUDA graph per token (nanoqwen.cuda.graph); without it, it launches
        every kernel from Python. `activations` picks the decode projections' input precision:
        "fp16" (Path B, the default) or "int8" (Path A of chapter 7: each projection's input is
        quantized to INT8 by a kernel of its own and multiplied with __dp4a; prefill is unchanged).
        With `pdl` (the default) the decode graph is captured with programmatic dependent launches
        (nanoqwen.cuda.launch), so each kernel may start while the one before it finishes; it
        changes nothing in eager launches, and falls back to plain launches, with a warning, where
        cuda.bindings is missing (`decode_graph().pdl` says which ran).

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
            from ..errors import BackendUnavailableError

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
        from .attention import check_config

        check_config(c)  # before the compile, whose static_asserts would say it less plainly
        self.num_pages = int(num_pages)
        self.max_seq_len = min(c.max_position_embeddings, self.num_pages * PAGE_SIZE)
        self.max_pages_per_seq = pages_needed(self.max_seq_len)
        self.num_sms = device.attributes["MultiProcessorCount"]
        self.stream = cp.cuda.Stream(non_blocking=True)

        module = cuda_build.compile_module(c)
        self.kernels = {
            name: StepKernel(module.get_function(name), name)
            for name in (
                "embed_tokens", "add_rmsnorm", "add_rmsnorm_cluster", "gemv_int4_from_hidden", QKV_ROPE_KERNEL,
                "gemv_int4_from_q_dim",
                "gemv_int4_from_intermediate", "gemv_int4_gate_up_silu", "dequantize_int4_to_half",
                "rope_write_kv", "silu_mul_rows", "lm_head_logits", "argmax_select_next",
            )
        }
        self.gemv_ring_bytes = {}  # GEMV kernel -> one warp's ring
        for name, percent in GEMV_CARVEOUT_PERCENT.items():
            set_carveout(self.kernels[name], percent)
            self.gemv_ring_bytes[name] = fit_gemv_rings(self.kernels[name], module, name)
        self.gate_up_splits = GATE_UP_SPLITS
        self.threads = block_threads(c)
        for name, threads in self.threads.items():
            if self.kernels[name].max_threads_per_block < threads:
                raise RuntimeError(f"kernel {name} cannot run {threads} threads per block on this GPU")

        with self.stream:
            self.layers = [self._upload_layer(model.layer(i)) for i in range(c.num_layers)]
            self.embed = cp.asarray(model.embed)  # fp16 [V, H]
            self.lm_head = self.embed if c.tie_word_embeddings else cp.asarray(model.lm_head)
            self.final_norm = cp.asarray(model.final_norm)
            self.inv_freq = cp.asarray(ops_numpy.rope_inv_freq(c.head_dim, c.rope_theta))  # fp32 [D/2]
            self.kv_pool = cp.zeros(kv_pool_shape(c, self.num_pages), dtype=cp.float16)
            self._kv_layers = [self.kv_pool[i] for i in range(c.num_layers)]
            self._allocate_decode_buffers()
            self.int8_layers = [self._int8_projections(i) for i in range(c.num_layers)] if activations == "int8" else None
        self.attention = (attention_factory or _default_attention())(c, self.num_pages, self.max_seq_len)
        self._weight_scratch = None  # fp16 expansion of one projection, made at the first prefill
        self.prefill_weights = self._keep_dense_weights(prefill_weights)
        self.use_graph = use_graph
        self._graph = None  # captured at the first graph decode
        self.rope_in_qkv = activations == "fp16"
        self.pdl = pdl
        self._device_holds = None  # (token, position, page table) the device state holds for the next step
        self._pending = None  # the page table of the step in flight
        self.host_draws = 0  # decode_next's steps whose token the host drew from the logits
        device.synchronize()  # uploads and attention's set-up may run on other streams

    # ------------------------------------------------------------------ setup

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
            splits=projection_splits(projection, out_features, in_features, self.num_sms, self.config.group_size),
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
            free, _ = cp.cuda.runtime.memGetInfo()
            free += cp.get_default_memory_pool().free_bytes()
            policy = "cache" if free >= dense_bytes + PREFILL_CACHE_HEADROOM_BYTES else "expand"
        if policy == "cache":
            with self.stream:
                for linear in self._linears():
                    linear.dense = cp.empty((linear.out_features, linear.in_features), dtype=cp.float16)
                    self._dequantize_into(linear, linear.dense)
        return policy

    def _int8_projections(self, layer: int) -> dict:
        """Path A launchers for one layer's four projections. Path A's kernel reads the file's
        row-major layout, so it gets its own copy of the weights (chapter 7 compares the paths;
        only this mode pays the memory)."""
        from .int8 import Int8Gemv

        cp, w = self._cp, self.model.layer(layer)
        projections = {}
        for name, linears in (("qkv", [w.q, w.k, w.v]), ("o", [w.o]), ("gate_up", [w.gate, w.up]), ("down", [w.down])):
            qweight, scales, bias = stack_linears(linears)
            projections[name] = Int8Gemv(self.config, cp.asarray(qweight), cp.asarray(scales),
                                         None if bias is None else cp.asarray(bias))
        return projections

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

    # ------------------------------------------------------------------ launches

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
            grid, block, shared_mem = gemv_launch("gemv_int4_gate_up_silu", c.intermediate_size, self.gate_up_splits,
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
            self._lm_head(choose=True)
            k["argmax_select_next"](
                (1,), (ARGMAX_THREADS,),
                (self.candidate_values, self.candidate_indices, np.int32(self.lm_head_blocks), self.state,
                 self.head_slots_address, np.int32(HEAD_SLOTS), self.logits, self.sampler, self.handed_back),
            )
        return self.launches_per_token

    # ------------------------------------------------------------------ checks

    def _check_positions(self, first: int, count: int, page_table) -> np.ndarray:
        return check_positions(first, count, page_table, self.num_pages, self.max_seq_len)

    def _check_tokens(self, token_ids) -> np.ndarray:
        return check_tokens(token_ids, self.config.vocab_size)

    # ------------------------------------------------------------------ decode

    def set_step_inputs(self, token_id: int, position: int, page_table) -> None:
        """One host-to-device copy of the step's inputs. The whole page table goes up, so that
        steps advanced on the device (argmax_select_next) find the pages reserved ahead."""
        token = int(self._check_tokens(np.array([token_id]))[0])
        self._upload_step_inputs(token, position, self._check_positions(position, 1, page_table))

    def _upload_step_inputs(self, token: int, position: int, pages: np.ndarray) -> None:
        """The copy itself, for inputs already checked."""
        host = np.empty(STATE_PAGE_TABLE + len(pages), dtype=np.int32)
        host[STATE_TOKEN], host[STATE_POSITION], host[STATE_SEQ_LEN] = token, position, position + 1
        host[STATE_STATUS] = 0
        host[STATE_PAGE_TABLE:] = pages
        self.state[: len(host)].set(host, stream=self.stream)
        self._device_holds = (token, int(position), pages)

    def decode_graph(self):
        """The decode step as a CUDA graph, captured on first use (nanoqwen.cuda.graph)."""
        if self._graph is None:
            from .graph import DecodeGraph

            self._graph = DecodeGraph(self, pdl=self._pdl)
        return self._graph

    pdl = GraphOption(
        "Whether the decode graph is to be captured with programmatic dependent launches.")
    rope_in_qkv = GraphOption(
        "Whether decode's q|k|v GEMV rotates its rows and writes the cache itself (gemv_int4_qkv_rope, "
        "the fp16 default); off, rope_write_kv does that after the plain GEMV, as with INT8 "
        "activations, which only have that form. Both write the same bits (tests/test_kernels_cuda.py).",
        allowed=lambda backend, enabled: not enabled or backend.activations == "fp16",
        refusal="rope_in_qkv needs fp16 activations: the INT8 path quantizes x for its own q|k|v GEMV")

    def forget_step_inputs(self) -> None:
        """Say the device state is unknown, so the next step uploads its inputs (call it after
        running steps outside `decode`/`decode_next`, as the benchmarks do)."""
        self._device_holds = None

    def _step(self, token_id: int, position: int, page_table) -> None:
        """Run one decode step for `token_id` at `position`.

        After a step chosen on the device the state already holds that token and the next
        position (argmax_select_next wrote them), so the next step's inputs are uploaded only
        when they differ: a token chosen on the host, a new request, a different page table. The inputs
        are checked on the host every time, uploaded or not.
        """
        token = int(self._check_tokens(np.array([token_id]))[0])
        pages = self._check_positions(position, 1, page_table)
        holds, self._device_holds = self._device_holds, None  # unknown until the step is read back
        if holds is None or holds[:2] != (token, position) or not np.array_equal(holds[2][: len(pages)], pages):
            self._upload_step_inputs(token, position, pages)  # checked above: no second check
            holds, self._device_holds = self._device_holds, None
        if self.use_graph:
            self.decode_graph().launch()
        else:
            self.decode_step_launches(self.stream)
        self._pending = holds[2]

    def decode(self, token_id: int, position: int, page_table) -> np.ndarray:
        """One token at `position` (its K/V is written there); logits [vocab] fp32.

        The caller samples the next token itself, so the device's choice is not read back (the
        sampler goes back to greedy, its cheapest) and the next step uploads its inputs.
        """
        self.set_sampler(GREEDY)
        self._step(token_id, position, page_table)
        return self.logits.get(stream=self.stream)

    def set_sampler(self, sampling: SamplingParams) -> None:
        """Put the sampler's settings where the decode step's last two kernels read them, when they
        change (one host-to-device copy, ordered before the steps that follow on the stream). The
        engine's requests set them; a benchmark of bare steps sets GREEDY first."""
        wanted = sampler_settings(sampling, self.config.vocab_size)
        if not np.array_equal(wanted, self._sampler_holds):
            self.sampler.set(wanted, stream=self.stream)
            self._sampler_holds = wanted

    def decode_next(self, token_id: int, position: int, page_table, sampling: SamplingParams = GREEDY) -> int:
        """The token `sampling` chooses after `decode` at `position`. The device chooses it (greedy,
        temperature, a top-k of at most TOP_K_MAX with or without top-p, a top-p alone whose run
        ends among the TOP_K_MAX most likely) and stores it (and the status word) in host memory;
        otherwise the host samples the logits (`host_draws` counts those steps). Non-finite logits
        raise FloatingPointError, as numpy's choice does."""
        if device_top_k(sampling, self.config.vocab_size) is None:
            self.host_draws += 1
            return sample(self.decode(token_id, position, page_table), sampling, position)
        self.set_sampler(sampling)
        self._step(token_id, position, page_table)
        self.stream.synchronize()
        token = self._token_after(position)
        if token is None:  # a top-p run longer than the device keeps
            return self._host_draw(position, sampling)
        self._device_holds = (token, position + 1, self._pending)
        return token

    def _host_draw(self, position: int, sampling: SamplingParams) -> int:
        """The token the host draws for the step at `position`, which left its draw to the host, from
        the logits that step copied to `handed_back` (waits for every step queued on the stream)."""
        self.host_draws += 1
        return sample(self.handed_back[position % HEAD_SLOTS].get(stream=self.stream), sampling, position)

    def _token_after(self, position: int) -> int | None:
        """The token that the finished step at `position` chose, from its row of `head_slots`
        (None: the host is to draw it)."""
        head = self.head_slots[position % HEAD_SLOTS]
        if head[STATE_POSITION] != position + 1:  # the row of another step: a bug, never data
            raise RuntimeError(f"the host's head row holds position {head[STATE_POSITION]} where the step at "
                               f"{position} should have left {position + 1}")
        return token_of_head(head)

    def next_tokens(self, token_id: int, position: int, page_table, steps: int, sampling: SamplingParams = GREEDY):
        """The next `steps` tokens after `token_id` at `position`, each chosen by `sampling` and fed
        back in turn.

        When the device chooses (decode_next says when) and the graph runs, the device advances
        its own state, so the host need not wait for token k before starting step k + 1: the
        generator keeps one step queued behind the one it reads. Each step's argmax stores the new
        state head (token, position, seq_len, status) in host memory itself, row position %
        HEAD_SLOTS of `head_slots`, so the queued step writes the other row; an event after each step
        says when its row is there. A device-to-host copy of the head after each step, between two
        graph launches, cost about 8 us per token on two H200s (results/graph-readback-h200.md). A
        consumer that stops early leaves at most one extra step computed, at a position inside the
        `steps` it asked for (the engine reserves their pages), never read.

        A top-p alone may leave a step's draw to the host (`may_hand_back`). That step copies its
        logits to `handed_back`, where the step queued behind it does not write; the host draws
        from them and runs the next step again from its token. After such a step the generator
        waits for each step until the device draws one again, so a flat stretch of steps wastes
        no more than its first.
        """
        if steps <= 0:
            return
        if device_top_k(sampling, self.config.vocab_size) is None or not self.use_graph:
            # the host chooses, or eager launches: one step at a time
            for k in range(steps):
                token_id = self.decode_next(token_id, position + k, page_table, sampling)
                yield token_id
            return
        cp = self._cp
        self._check_positions(position, steps, page_table)  # the whole run, once
        self.set_sampler(sampling)
        self._step(token_id, position, page_table)  # checks and uploads the first step's inputs, runs it
        graph = self.decode_graph()
        done = [cp.cuda.Event(disable_timing=True) for _ in range(HEAD_SLOTS)]
        done[position % HEAD_SLOTS].record(self.stream)
        end, launched, run_ahead = position + steps, position, True  # launched: the last step on the stream

        def launch_next(p: int) -> int:
            graph.launch()  # step p + 1 reads the token step p chose, on the device
            done[(p + 1) % HEAD_SLOTS].record(self.stream)
            return p + 1

        try:
            for p in range(position, end):
                if run_ahead and launched == p and p + 1 < end:
                    launched = launch_next(p)
                done[p % HEAD_SLOTS].synchronize()
                token = self._token_after(p)
                if token is None:  # drawn on the host, from the logits step p copied aside
                    if not may_hand_back(sampling, self.config.vocab_size):
                        raise RuntimeError(f"the step at {p} left its draw to the host with {sampling}")
                    token = self._host_draw(p, sampling)
                    if p + 1 < end:  # step p + 1 again (or first), from the host's token
                        self._device_holds = None
                        self._step(token, p + 1, page_table)
                        done[(p + 1) % HEAD_SLOTS].record(self.stream)
                        launched = p + 1
                    run_ahead = False  # a flat stretch: wait for each step until the device draws again
                else:
                    if launched == p and p + 1 < end:
                        launched = launch_next(p)
                    run_ahead = True
                yield token
        finally:
            self._device_holds = None  # a step may have run ahead: the next request uploads

    def close(self) -> None:
        """Wait until no queued step can still store into `head_slots`, whose host memory goes
        with this backend (Engine.close calls it)."""
        self.stream.synchronize()

    # ------------------------------------------------------------------ prefill

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

    def _prefill_chunk(self, token_ids: np.ndarray, start_pos: int, last: bool) -> None:
        cp, c, k = self._cp, self.config, self.kernels
        t, H = len(token_ids), c.hidden_size
        ids = cp.asarray(token_ids)
        self.prefill_start.set(np.array([start_pos], dtype=np.int32), stream=self.stream)
        residual = cp.empty((t, H), dtype=cp.float32)
        normed = cp.empty((t, H), dtype=cp.float16)
        delta = cp.empty((t, H), dtype=cp.float32)
        qkv = cp.empty((t, self.layers[0].qkv.out_features), dtype=cp.float32)
        q = cp.empty((t, c.q_dim), dtype=cp.float32)
        attn = cp.empty((t, c.q_dim), dtype=cp.float16)
        gate_up = cp.empty((t, 2 * c.intermediate_size), dtype=cp.float32)
        hidden = cp.empty((t, c.intermediate_size), dtype=cp.float16)

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
