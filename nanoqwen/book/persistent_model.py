"""The persistent decode kernel's schedule (kernels/decode_persistent.cu) laid out on the host, for chapter 13.

Every block of the kernel walks the same operations in the same order and takes an equal run of
each operation's units; before its first unit it waits on a counter of the tiles its input needs,
and every finished tile adds one to the counter of its operation. This module computes that walk
for any shape and SM count (the units, the runs, what each operation waits for) and plays it out,
block by block, with the counters: every wait is met and every tile is finished exactly once, or
`play` says which block waits on what. That is the kernel's argument against deadlock (all blocks
are resident, and no operation waits on a later one), checked without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..cuda.attention import split_pages
from ..quant import TILE_ROWS

OPERATIONS = ("q|k|v + RoPE", "attention", "combine", "o", "gate+up", "down")


@dataclass(frozen=True)
class Operation:
    """One operation of a layer: `units` units, `tiles` finished tiles it counts (a GEMV's tile is
    finished by the last of its `splits` units; attention and combine count each unit), and the
    operation before it whose count it waits for (`waits_on`, an index into the step's operations,
    or None) and the count it needs (`target`)."""

    name: str
    layer: int
    units: int
    splits: int
    waits_on: int | None
    target: int

    @property
    def tiles(self) -> int:
        return self.units // self.splits


def step_operations(config: ModelConfig, splits: dict[str, int], context: int, attention_splits: int) -> list[Operation]:
    """Every operation of a decode step in the order the blocks walk them; `splits` holds the GEMVs'
    splits of K ("qkv", "o", "gate_up", "down", as the decode kernels split them)."""
    c = config
    qkv_tiles = (c.q_dim + 2 * c.kv_dim) // TILE_ROWS
    hidden_tiles = -(-c.hidden_size // TILE_ROWS)
    mlp_tiles = -(-c.intermediate_size // TILE_ROWS)
    active = len(split_pages(context, attention_splits))  # the attention's splits with pages
    ops: list[Operation] = []
    for layer in range(c.num_layers):
        down_before = len(ops) - 1 if layer else None
        first = len(ops)
        ops.append(Operation(OPERATIONS[0], layer, qkv_tiles * splits["qkv"], splits["qkv"], down_before, hidden_tiles))
        ops.append(Operation(OPERATIONS[1], layer, active * c.num_kv_heads, 1, first, qkv_tiles))
        if active > 1:
            ops.append(Operation(OPERATIONS[2], layer, c.num_heads, 1, first + 1, active * c.num_kv_heads))
            o_waits_on, o_target = first + 2, c.num_heads
        else:
            o_waits_on, o_target = first + 1, c.num_kv_heads
        ops.append(Operation(OPERATIONS[3], layer, hidden_tiles * splits["o"], splits["o"], o_waits_on, o_target))
        ops.append(Operation(OPERATIONS[4], layer, mlp_tiles * splits["gate_up"], splits["gate_up"], len(ops) - 1,
                             hidden_tiles))
        ops.append(Operation(OPERATIONS[5], layer, hidden_tiles * splits["down"], splits["down"], len(ops) - 1,
                             mlp_tiles))
    return ops


def block_share(units: int, blocks: int, block: int) -> range:
    """The units block `block` of `blocks` takes: an equal run in block order."""
    return range(block * units // blocks, (block + 1) * units // blocks)


def play(ops: list[Operation], blocks: int) -> list[tuple[int, int]]:
    """Play the step: each round, every block whose next operation's wait is met does its units of
    it (a GEMV tile counts once all its splits are in). Returns the (round, operation) in which each
    block finished each operation it took part in; raises RuntimeError naming a block and its wait
    if no block can move (a deadlock), or if a count ends anywhere but its operation's tiles."""
    done = [0] * len(ops)  # tiles finished, per operation
    splits_in = [dict() for _ in ops]  # per operation: tile -> splits in
    position = [0] * blocks  # the next operation of each block
    finished = []
    round_ = 0
    while any(p < len(ops) for p in position):
        moved = False
        for b in range(blocks):
            while position[b] < len(ops):
                k = position[b]
                op = ops[k]
                share = block_share(op.units, blocks, b)
                if not share:  # no part in it: on to the next, without waiting
                    position[b] += 1
                    continue
                if op.waits_on is not None and done[op.waits_on] < op.target:
                    break
                for unit in share:
                    tile = unit // op.splits
                    splits_in[k][tile] = splits_in[k].get(tile, 0) + 1
                    if splits_in[k][tile] == op.splits:
                        done[k] += 1
                finished.append((round_, k))
                position[b] += 1
                moved = True
                break  # one operation per block per round
        if not moved:
            stuck = next(b for b in range(blocks) if position[b] < len(ops))
            op = ops[position[stuck]]
            raise RuntimeError(f"deadlock: block {stuck} waits in layer {op.layer}'s {op.name} for "
                               f"{op.target} of operation {op.waits_on}, which has {done[op.waits_on]}")
        round_ += 1
    for k, op in enumerate(ops):
        if done[k] != op.tiles:
            raise RuntimeError(f"layer {op.layer}'s {op.name} counted {done[k]} tiles of {op.tiles}")
    return finished
