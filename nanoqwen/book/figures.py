"""Figures of the paged-attention chapter whose drawing code is no part of the lesson: the
chapter shows the picture, this module keeps the matplotlib. Each function draws one figure
and returns it (the notebook displays it)."""

from __future__ import annotations

from ..config import PAGE_SIZE

__all__ = ["decode_vs_floor", "paged_layout"]


def paged_layout(page_table=(7, 2, 9, 4), seq_len: int = 53, pool_pages: int = 12, kv_heads: int = 4):
    """One layer of the pool with a sequence's pages scattered through it (the tail page partly
    filled), and one page unfolded into its K and V slices, one per KV head."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw=dict(width_ratios=[2.2, 1]))
    for page in range(pool_pages):
        owned = page in page_table
        ax.add_patch(Rectangle((page, 0), 0.9, 1, facecolor="#cfe2f3" if owned else "#eeeeee", edgecolor="k"))
        ax.text(page + 0.45, 0.5, f"page\n{page}", ha="center", va="center", fontsize=8)
    for i, page in enumerate(page_table):
        rows_used = min(PAGE_SIZE, seq_len - PAGE_SIZE * i)
        ax.add_patch(Rectangle((page, 0), 0.9, rows_used / PAGE_SIZE, facecolor="#3d85c6", alpha=0.55))
        ax.add_patch(Rectangle((i * 1.6 + 2.0, 2.1), 1.4, 0.6, facecolor="white", edgecolor="k"))
        ax.text(i * 1.6 + 2.7, 2.4, f"table[{i}] = {page}\npositions {PAGE_SIZE * i}..{PAGE_SIZE * i + rows_used - 1}",
                ha="center", va="center", fontsize=7.5)
        ax.add_patch(FancyArrowPatch((i * 1.6 + 2.7, 2.1), (page + 0.45, 1.0), arrowstyle="->", mutation_scale=10))
    tail_rows = seq_len - PAGE_SIZE * (len(page_table) - 1)
    ax.text(page_table[-1] + 0.45, -0.25, f"tail: {tail_rows} of {PAGE_SIZE} rows", ha="center", fontsize=8)
    ax.set_xlim(-0.2, pool_pages + 0.1)
    ax.set_ylim(-0.5, 2.9)
    ax.axis("off")
    ax.set_title("one layer of the pool: the sequence's page table points anywhere")
    for kv in range(2):  # one page, unfolded: [2 (K, V), KV heads, 16 rows, head_dim]
        for head in range(kv_heads):
            x, y = head * 1.1, (1 - kv) * 1.3
            zoom.add_patch(Rectangle((x, y), 1.0, 1.1, facecolor="#f6b26b" if kv == 0 else "#93c47d", edgecolor="k"))
            zoom.text(x + 0.5, y + 0.55, f"{'KV'[kv]} head {head}\n16 x 128\n4 KiB", ha="center", va="center",
                      fontsize=7)
    zoom.set_xlim(-0.1, 1.1 * kv_heads + 0.1)
    zoom.set_ylim(-0.1, 2.6)
    zoom.axis("off")
    zoom.set_title(f"one page = {2 * kv_heads} slices, each one bulk copy")
    fig.tight_layout()
    return fig


def decode_vs_floor(decode_timing):
    """Bars of the recorded decode attention time per layer next to its K/V byte floor, for the
    default grid's rows of `tools/gpu_check_attention.py`'s `decode_timing`."""
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in decode_timing if r["variant"] == "default"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["us"] for r in rows], 0.4, label="decode attention (2 launches)")
    ax.bar(x + 0.2, [r["floor_us"] for r in rows], 0.4, label="K/V bytes at copy bandwidth")
    ax.set_xticks(x, [str(r["seq_len"]) for r in rows])
    ax.set_xlabel("positions")
    ax.set_ylabel("µs per layer")
    ax.legend()
    ax.set_title("decode attention, 7B shape, one layer, H200")
    fig.tight_layout()
    return fig
