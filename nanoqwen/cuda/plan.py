"""Launch geometry and tuning of the decode step: how many warps and blocks each kernel gets.

Everything here is arithmetic on the model's shapes, the GPU's multiprocessor count and what one
multiprocessor holds (SmBudget, Hopper's by default), so it runs without a GPU (the compile check
and the book plan launches on a CPU). The numbers a kernel fixes (block sizes, the most warps a
block holds) come from nanoqwen.cuda.abi.

A decode GEMV's time is set by how many bytes each SM has in flight, not by arithmetic: its warps
copy groups of weights into shared-memory rings ahead of the multiply. So every choice below is
about bytes in flight per SM and where a kernel's blocks land while the kernel before it finishes.
"""

from __future__ import annotations

from typing import NamedTuple

from ..quant import TILE_ROWS
from .abi import (
    ARGMAX_THREADS,
    CHAIN_GEMV_MIN_BLOCKS,
    GATE_UP_MAX_SPLITS,
    GATE_UP_MIN_BLOCKS,
    GEMV_MAX_SPLITS,
    LM_HEAD_THREADS,
    NARROW_ROWS,
    RMS_CLUSTER,
)
from .build import macro_defaults

# Split K so that each SM gets about this many GEMV warps (each keeps a ring of groups in flight):
# down_proj's split. Fewer leave bytes unrequested; more make each warp's range too short.
GEMV_WARPS_PER_SM = 16
MIN_GROUPS_PER_SPLIT = 4  # shorter splits leave most of a warp's copy ring (4-6 groups) idle
GEMV_KERNELS = {"qkv": "gemv_int4_from_hidden", "o": "gemv_int4_from_q_dim", "down": "gemv_int4_from_intermediate"}
# Decode's fp16 q|k|v: gemv_int4_from_hidden's work with RoPE and the cache write in its epilogue.
QKV_ROPE_KERNEL = "gemv_int4_qkv_rope"
# Each GEMV's preferred shared-memory carve-out, in percent of each SM's capacity (-1 leaves the
# driver's choice). An SM can change its split of L1 and shared memory only when it is empty, so
# the GEMVs, whose blocks start early beside the kernel before them, all ask for the whole
# capacity, the split gate+up's blocks get from the driver.
GEMV_CARVEOUT_PERCENT = {"gemv_int4_from_hidden": 100, QKV_ROPE_KERNEL: 100, "gemv_int4_from_q_dim": 100,
                         "gemv_int4_from_intermediate": 100, "gemv_int4_gate_up_silu": -1}
# GEMV kernel -> the macro of kernels/gemv_int4.cu that sets its ring depth
GEMV_STAGES_MACROS = {"gemv_int4_from_hidden": "NQ_FROM_HIDDEN_STAGES", QKV_ROPE_KERNEL: "NQ_FROM_HIDDEN_STAGES",
                      "gemv_int4_from_q_dim": "NQ_FROM_Q_DIM_STAGES",
                      "gemv_int4_from_intermediate": "NQ_FROM_INTERMEDIATE_STAGES",
                      "gemv_int4_gate_up_silu": "NQ_GATE_UP_STAGES"}
# GEMV kernel -> the most warps (splits) a block holds; each warp has a ring of shared memory, whose
# size the module's `__device__ int <kernel>_ring_bytes` holds.
GEMV_MAX_WARPS = {**{name: GEMV_MAX_SPLITS for name in (*GEMV_KERNELS.values(), QKV_ROPE_KERNEL)},
                  "gemv_int4_gate_up_silu": GATE_UP_MAX_SPLITS}


class SmBudget(NamedTuple):
    """What one SM holds at once (the device's attributes); Hopper's are the defaults, so that the
    plan runs without a GPU."""
    registers: int = 65536
    threads: int = 2048
    blocks: int = 32
    shared_bytes: int = 228 * 1024


HOPPER_SM = SmBudget()
# An SM hands out registers per warp in units of 256, from the quarter of its file that belongs to
# the scheduler the warp runs on, and keeps 1 KiB of shared memory for each resident block.
REGISTER_UNIT, SCHEDULERS_PER_SM, SHARED_RESERVED_PER_BLOCK = 256, 4, 1024


def resident_blocks(warps: int, registers: int, shared_bytes: int, sm: SmBudget = HOPPER_SM) -> int:
    """How many blocks of `warps` warps, `registers` per thread and `shared_bytes` of shared memory
    (static and dynamic) an SM holds at once, as the driver's occupancy calculation counts them."""
    warp_registers = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    warps_by_registers = sm.registers // SCHEDULERS_PER_SM // warp_registers * SCHEDULERS_PER_SM
    return min(warps_by_registers // warps, sm.threads // (32 * warps), sm.blocks,
               sm.shared_bytes // (shared_bytes + SHARED_RESERVED_PER_BLOCK))


def bounded_registers(min_blocks: int, warps: int, sm: SmBudget = HOPPER_SM) -> int:
    """The registers a thread takes at most in a kernel compiled with
    `__launch_bounds__(warps * 32, min_blocks)`: what `min_blocks` such blocks leave each thread,
    in whole units of 8 (a warp's 256)."""
    return sm.registers // (min_blocks * warps * 32) // 8 * 8


def chain_gemv_registers(sm: SmBudget = HOPPER_SM) -> int:
    """The registers a thread of q|k|v and o takes at most: they compile for CHAIN_GEMV_MIN_BLOCKS
    blocks of GEMV_MAX_SPLITS warps per SM (kernels/gemv_int4.cu)."""
    return bounded_registers(CHAIN_GEMV_MIN_BLOCKS, GEMV_MAX_SPLITS, sm)


def gate_up_registers(sm: SmBudget = HOPPER_SM) -> int:
    """The registers a thread of gate+up takes at most: it compiles for GATE_UP_MIN_BLOCKS blocks of
    GATE_UP_MAX_SPLITS warps per SM (kernels/gemv_int4.cu)."""
    return bounded_registers(GATE_UP_MIN_BLOCKS, GATE_UP_MAX_SPLITS, sm)


def default_stages(kernel: str) -> int:
    """GEMV `kernel`'s ring depth as kernels/gemv_int4.cu sets it when no -D option does."""
    return int(macro_defaults("gemv_int4.cu")[GEMV_STAGES_MACROS[kernel]])


CHAIN_GEMV_STAGES = max(default_stages(GEMV_KERNELS[projection]) for projection in ("qkv", "o"))  # the deeper ring


def chain_block_shared_bytes(splits: int, group_size: int) -> int:
    """Shared memory of a q|k|v or o block of `splits` warps: a CHAIN_GEMV_STAGES-deep ring per warp
    and the block's split sums, GEMV_MAX_SPLITS x 16 fp32."""
    return splits * planned_ring_bytes(QKV_ROPE_KERNEL, CHAIN_GEMV_STAGES, group_size) + GEMV_MAX_SPLITS * TILE_ROWS * 4


GATE_UP_STAGES = default_stages("gemv_int4_gate_up_silu")


def gate_up_block_shared_bytes(splits: int, hidden_size: int, group_size: int) -> int:
    """Shared memory of a gate+up block of `splits` warps: a GATE_UP_STAGES-deep ring per warp, the
    two tiles' scales (16 rows x the input's groups of fp16 each) and the split sums
    (GATE_UP_MAX_SPLITS x 2 tiles x 16 fp32), each static array placed in whole 128 bytes."""
    def placed(size: int) -> int:
        return -(-size // 128) * 128

    groups = hidden_size // group_size
    return (splits * planned_ring_bytes("gemv_int4_gate_up_silu", GATE_UP_STAGES, group_size)
            + placed(2 * TILE_ROWS * groups * 2) + placed(GATE_UP_MAX_SPLITS * 2 * TILE_ROWS * 4))


# Fewer groups than this per warp leave most of gate+up's 4-deep ring idle.
GATE_UP_MIN_GROUPS_PER_SPLIT = 2
# A last wave of blocks less full than this share of the GPU runs nearly alone, after the rest.
LAST_WAVE_MIN_FILL = 0.25


def gate_up_splits(intermediate_size: int, hidden_size: int, num_sms: int, group_size: int = 128,
                   sm: SmBudget = HOPPER_SM) -> int:
    """Warps per tile of the fused gate+up GEMV (each a share of the input groups): the most, up to
    GATE_UP_MAX_SPLITS with at least GATE_UP_MIN_GROUPS_PER_SPLIT groups each, whose blocks do not
    end in a last wave less than LAST_WAVE_MIN_FILL full. gate+up is the step's largest GEMV, with
    tiles to spare: its blocks start as SMs free up, and the SMs that free up last are the step's
    tail. More warps per tile make a block shorter, so that tail shorter, except where they spill
    a few blocks into a wave of their own."""
    tiles = -(-intermediate_size // TILE_ROWS)
    most = max(1, min(GATE_UP_MAX_SPLITS, hidden_size // group_size // GATE_UP_MIN_GROUPS_PER_SPLIT))
    registers = gate_up_registers(sm)
    for splits in range(most, 1, -1):
        per_wave = num_sms * resident_blocks(splits, registers, gate_up_block_shared_bytes(splits, hidden_size, group_size), sm)
        if per_wave == 0:
            continue
        last_wave = tiles % per_wave
        if tiles <= per_wave or last_wave == 0 or last_wave >= LAST_WAVE_MIN_FILL * per_wave:
            return splits
    return min(most, 2)


# The share of each SM that a chain GEMV's busiest SM may fill with its blocks. o's blocks land
# while the attention kernels before it still hold registers on every SM, and an SM that o filled
# wholly would hold its last blocks back until they left; q|k|v's land beside the norm's few.
CHAIN_GEMV_SM_SHARE = {"qkv": 1.0, "o": 0.75}


def chain_sm_budget(projection: str, sm: SmBudget = HOPPER_SM) -> SmBudget:
    """The part of each SM that q|k|v's or o's blocks may fill (CHAIN_GEMV_SM_SHARE)."""
    share = CHAIN_GEMV_SM_SHARE[projection]
    return sm._replace(registers=int(sm.registers * share), threads=int(sm.threads * share))


def chain_splits(projection: str, out_features: int, in_features: int, num_sms: int, group_size: int = 128,
                 sm: SmBudget = HOPPER_SM) -> int:
    """Split-K factor of q|k|v or o: the most warps per tile with which every block of the GEMV is
    resident at once, within the projection's CHAIN_GEMV_SM_SHARE of each SM. These two sit on the
    step's chain of small kernels, where nothing hides a second wave of blocks and a warp's range is
    its time: more warps per tile put more of the weights in flight at the start and give each warp
    fewer groups."""
    tiles = -(-out_features // TILE_ROWS)
    busiest = -(-tiles // num_sms)  # blocks on the SM that gets the most
    budget = chain_sm_budget(projection, sm)
    registers = chain_gemv_registers(sm)
    for splits in range(min(in_features // group_size, GEMV_MAX_SPLITS), 1, -1):
        if busiest <= resident_blocks(splits, registers, chain_block_shared_bytes(splits, group_size), budget):
            return splits
    return 1


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


def projection_splits(projection: str, out_features: int, in_features: int, num_sms: int, group_size: int = 128,
                      sm: SmBudget = HOPPER_SM) -> int:
    """The split-K factor the engine gives a decode projection ("qkv", "o", "down", "gate_up", whose
    out_features count gate's rows and up's): the chain GEMVs' `chain_splits`, the fused gate+up's
    `gate_up_splits`, down's `gemv_splits`."""
    if projection in CHAIN_GEMV_SM_SHARE:
        return chain_splits(projection, out_features, in_features, num_sms, group_size, sm)
    if projection == "gate_up":
        return gate_up_splits(out_features // 2, in_features, num_sms, group_size, sm)
    return gemv_splits(out_features, in_features, num_sms, group_size)


def gemv_launch(kernel: str, rows: int, splits: int, ring_bytes: int) -> tuple[tuple[int], tuple[int], int]:
    """(grid, block, dynamic shared bytes) of a GEMV of GEMV_MAX_WARPS: one block per 16-row tile of its
    `rows` output rows (gate+up: gate's, each block taking up's same rows too), `splits` warps in
    it, each with a ring of `ring_bytes` (fit_gemv_rings)."""
    most = GEMV_MAX_WARPS[kernel]
    if not 1 <= splits <= most:
        raise ValueError(f"a {kernel} block holds 1..{most} splits, got {splits}")
    return (-(-rows // TILE_ROWS),), (splits * 32,), splits * ring_bytes


def planned_ring_bytes(name: str, stages: int, group_size: int) -> int:
    """One warp's ring of GEMV `name` as kernels/gemv_int4.cu's GemvRing lays it out: per slot, the
    warp's tiles' (gate+up: two) 16 rows x group_size / 2 bytes of weights and group_size fp16 of x.
    The engine launches with the device's own figure (fit_gemv_rings); this plans without a GPU."""
    tiles = 2 if name == "gemv_int4_gate_up_silu" else 1
    return stages * (tiles * TILE_ROWS * group_size // 2 + 2 * group_size)


class VerifyGemv(NamedTuple):
    """A verify-pass GEMV (kernels/verify.cu): decode's GEMV of `projection` (`decode_kernel`, whose
    warps per block, launch geometry, ring depth and carve-out it takes) for several tokens."""
    projection: str
    decode_kernel: str


# A verify pass runs decode's GEMVs for up to abi.VERIFY_ROWS tokens, each GEMV in two widths: a
# narrow kernel for up to abi.NARROW_ROWS tokens and a wide one for more (kernels/verify.cu).
VERIFY_WIDTHS = ("narrow", "wide")
VERIFY_GEMVS = {
    "gemv_int4_qkv_rope_rows": VerifyGemv("qkv", QKV_ROPE_KERNEL),
    "gemv_int4_rows_from_q_dim": VerifyGemv("o", "gemv_int4_from_q_dim"),
    "gemv_int4_gate_up_silu_rows": VerifyGemv("gate_up", "gemv_int4_gate_up_silu"),
    "gemv_int4_rows_from_intermediate": VerifyGemv("down", "gemv_int4_from_intermediate"),
}


def verify_kernel(name: str, tokens: int) -> str:
    """The kernel of verify GEMV `name` (a VERIFY_GEMVS key) for a pass of `tokens` rows."""
    return f"{name}_{VERIFY_WIDTHS[0] if tokens <= NARROW_ROWS else VERIFY_WIDTHS[1]}"


def verify_splits(kernel: str, config, num_sms: int, sm: SmBudget = HOPPER_SM) -> int:
    """Warps per block of a verify GEMV: decode's split of the same projection, so that each row's
    sums are added in decode's order. The pass launches with the uploaded layer's own `splits`;
    this sizes the kernels' shared memory before the layers are uploaded."""
    projection = VERIFY_GEMVS[kernel].projection
    out_features, in_features = config.projection_shapes[projection]
    return projection_splits(projection, out_features, in_features, num_sms, config.group_size, sm)
