"""Every layer of a decode step in one launch: the host side of kernels/decode_persistent.cu.

With `CudaBackend.persistent` on (off by default: on an H100 it decodes the 7B in 3.8 ms per token
against 1.9 ms with a kernel per operation, results/decode-by-size-h100.md and chapter 13 say why), a
decode step is four launches instead of 8 per layer:

    embed_tokens                 state.token -> residual
    decode_layers_persistent     one block per SM: every layer, then the final norm -> normed
    lm_head_logits, argmax_select_next

The kernel walks the layers' operations in the multi-kernel step's order; an operation waits on a
counter in global memory for the tiles it reads instead of for a kernel boundary, and its blocks
request their weights before they wait. Its numbers are the multi-kernel step's bits (the same
splits, group arithmetic, norm order and attention units), so the verify pass, which runs the
multi-kernel sequence with a token dimension, still makes the tokens a decode step makes.

It needs every block resident at once (a block spins on counters that other blocks advance): one
block per SM, and nothing else running on the GPU while it runs, which the engine's one stream
gives. A wait that outlasts 10 s stops the kernel with a message instead of hanging the GPU.
"""

from __future__ import annotations

import numpy as np

from . import build
from .abi import LAYER_POINTERS, OPS_PER_LAYER, PERSIST_THREADS, TILE_ROWS, kernel_int
from .device import set_carveout

KERNEL = "decode_layers_persistent"
KERNEL_FILE = "decode_persistent.cu"
# The layer table's columns, named as kernels/decode_persistent.cu names them (LAYER_*).
LAYER_COLUMNS = ("QKV_QWEIGHT", "QKV_SCALES", "QKV_BIAS", "O_QWEIGHT", "O_SCALES", "GATE_UP_QWEIGHT", "GATE_UP_SCALES",
                 "DOWN_QWEIGHT", "DOWN_SCALES", "INPUT_NORM", "POST_NORM", "KV")


def persistent_refusal(backend) -> str | None:
    """Why `backend` cannot decode with the persistent kernel (None: it can)."""
    if backend.activations != "fp16":
        return "the persistent decode kernel multiplies fp16 activations; this backend decodes with INT8"
    if not all(hasattr(backend.attention, name) for name in ("partial_max_sum", "partial_acc", "splits")):
        return f"the persistent decode kernel runs the paged attention itself, not {type(backend.attention).__name__}"
    return None


class PersistentLayers:
    """The persistent kernel of one backend: its layer table, counters and launch."""

    def __init__(self, backend, module):
        cp, c = backend._cp, backend.config
        self.backend = backend
        self.kernel = backend.kernels[KERNEL]
        self.shared_bytes = build.module_int(module, "decode_persistent_smem_bytes")
        self.kernel.max_dynamic_shared_size_bytes = self.shared_bytes
        set_carveout(self.kernel, 100)
        per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(self.kernel.kernel.ptr, PERSIST_THREADS,
                                                                          self.shared_bytes)
        if per_sm < 1:
            raise RuntimeError(f"{KERNEL} does not fit an SM ({self.shared_bytes} bytes of shared memory, "
                               f"{PERSIST_THREADS} threads)")
        self.blocks = backend.num_sms
        columns = {name: kernel_int(KERNEL_FILE, f"LAYER_{name}") for name in LAYER_COLUMNS}
        if sorted(columns.values()) != list(range(LAYER_POINTERS)):
            raise RuntimeError(f"kernels/{KERNEL_FILE}'s layer table has columns {columns}, not 0..{LAYER_POINTERS - 1}")
        table = np.zeros((c.num_layers, LAYER_POINTERS), dtype=np.uint64)
        for i, layer in enumerate(backend.layers):
            pointers = {
                "QKV_QWEIGHT": layer.qkv.qweight, "QKV_SCALES": layer.qkv.scales, "QKV_BIAS": layer.qkv.bias,
                "O_QWEIGHT": layer.o.qweight, "O_SCALES": layer.o.scales,
                "GATE_UP_QWEIGHT": layer.gate_up.qweight, "GATE_UP_SCALES": layer.gate_up.scales,
                "DOWN_QWEIGHT": layer.down.qweight, "DOWN_SCALES": layer.down.scales,
                "INPUT_NORM": layer.input_norm, "POST_NORM": layer.post_norm, "KV": backend._kv_layers[i],
            }
            for name, array in pointers.items():
                table[i, columns[name]] = 0 if array is None else array.data.ptr
        self.layer_table = cp.asarray(table)
        first = backend.layers[0]
        self.splits = {"qkv": first.qkv.splits, "o": first.o.splits, "gate_up": first.gate_up.splits, "down": first.down.splits}
        hidden, mlp = (build.module_int(module, f"abi_{name}_TILES") for name in ("HIDDEN", "MLP"))
        tiles = {"qkv": build.module_int(module, "abi_QKV_TILES"), "o": hidden, "gate_up": mlp, "down": hidden}
        sums_per_pair = {k: (2 if k == "gate_up" else 1) * TILE_ROWS for k in tiles}  # gate+up's pairs hold two tiles
        self.split_partials = cp.empty(max(tiles[k] * self.splits[k] * sums_per_pair[k] for k in tiles), dtype=cp.float32)
        self.tile_arrivals = cp.zeros(max(tiles.values()), dtype=cp.uint32)
        self.done = cp.zeros(c.num_layers * OPS_PER_LAYER, dtype=cp.uint32)

    def launch(self) -> None:
        """The layers of one step on the current stream: `residual` (the embedding) in, `normed` out."""
        b, attention = self.backend, self.backend.attention
        self.kernel(
            (self.blocks,), (PERSIST_THREADS,),
            (self.layer_table, b.state, b.inv_freq, b.final_norm, b.residual, b.q, b.attn_out, b.mlp_hidden, b.normed,
             attention.partial_max_sum, attention.partial_acc, np.int32(attention.splits), self.split_partials,
             self.tile_arrivals, self.done, np.int32(b.config.num_layers), np.int32(self.splits["qkv"]),
             np.int32(self.splits["o"]), np.int32(self.splits["gate_up"]), np.int32(self.splits["down"])),
            shared_mem=self.shared_bytes,
        )
