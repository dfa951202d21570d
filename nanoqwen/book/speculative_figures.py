"""Helpers of the speculative-decoding chapter whose code is no part of the lesson: a recorder of
the passes an engine runs over the weights, and the chapter's figure. Each figure function draws
one figure and returns it (the notebook displays it)."""

from __future__ import annotations

__all__ = ["recorded_passes", "speculation_costs"]


def recorded_passes(engine, prompt, **kwargs):
    """`engine.generate(prompt, **kwargs)` and every pass over the weights it ran after prefill,
    as (position, drafts, tokens made): a verify pass, or a plain step (no drafts) where prompt
    lookup found nothing. The backend's `verify` and `decode_next` are wrapped for the call only, so
    plain steps are recorded where they go through `decode_next`, as the numpy backend's
    `next_tokens` takes them (the CUDA pipeline launches its graph directly)."""
    backend, passes = engine.backend, []
    verify, decode_next = backend.verify, backend.decode_next

    def recording_verify(token, drafts, position, *args, **options):
        tokens = verify(token, drafts, position, *args, **options)
        passes.append((position, list(drafts), list(tokens)))
        return tokens

    def recording_decode_next(token, position, *args, **options):
        chosen = decode_next(token, position, *args, **options)
        passes.append((position, [], [chosen]))
        return chosen

    backend.verify, backend.decode_next = recording_verify, recording_decode_next
    try:
        result = engine.generate(prompt, **kwargs)
    finally:
        del backend.verify, backend.decode_next  # the class's methods again
    return result, passes


def speculation_costs(record: dict, predicted_ms: dict[int, float]):
    """Two panels from a `tools/bench_speculative.py` record: the wall time of one pass against its
    rows (measured, the chapter's prediction, the byte floor, and what plain decoding pays for as
    many tokens), and the effective ms/token of each prompt and draft count against plain decoding.
    `predicted_ms`: rows -> predicted ms of a pass."""
    import matplotlib.pyplot as plt
    import numpy as np

    costs = {int(k): ms for k, ms in record["pass_costs_ms"].items()}
    plain, floor = record["plain_ms_per_token"], record["floor_ms"]
    fig, (cost, effective) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw=dict(width_ratios=[1.1, 1]))

    rows = np.array(sorted(k + 1 for k in costs))
    cost.plot(rows, [costs[r - 1] for r in rows], "o-", color="tab:blue", label="measured pass (wall, host included)")
    cost.plot(sorted(predicted_ms), [predicted_ms[r] for r in sorted(predicted_ms)], "s--", color="tab:orange",
              ms=4, label="the prediction")
    cost.plot(rows, rows * plain, ":", color="tab:green", label="as many tokens of plain decoding")
    cost.axhline(floor, color="gray", lw=1, ls="-.", label="byte floor of any pass")
    cost.set(xlabel="rows in the pass (1 = a decode step; k drafts = k + 1 rows)", ylabel="ms per pass",
             xticks=rows, ylim=(0, max(costs.values()) * 1.25), title="one pass over the 7B's weights")
    cost.grid(alpha=0.3)
    cost.legend(fontsize=8, loc="upper left")

    prompts = list(dict.fromkeys(e["prompt"] for e in record["effective"]))
    counts = sorted({e["speculate"] for e in record["effective"]})
    width = 0.8 / len(counts)
    for i, n in enumerate(counts):
        values = [next(e["ms_per_token"] for e in record["effective"] if e["prompt"] == p and e["speculate"] == n)
                  for p in prompts]
        effective.bar(np.arange(len(prompts)) + (i - (len(counts) - 1) / 2) * width, values, width,
                      label=f"speculate={n}", color=plt.cm.Blues(0.4 + 0.5 * i / max(1, len(counts) - 1)))
    effective.axhline(plain, color="tab:green", ls=":", label=f"plain decoding, {plain:.2f} ms")
    effective.axhline(floor, color="gray", lw=1, ls="-.", label="byte floor of one token")
    effective.set_xticks(range(len(prompts)), prompts, fontsize=8)
    effective.set(ylabel="7B ms per token", title="nano-coder's passes at the 7B's pass costs")
    effective.grid(alpha=0.3, axis="y")
    effective.legend(fontsize=8, loc="upper left", ncol=2)
    effective.set_ylim(0, max(e["ms_per_token"] for e in record["effective"]) * 1.35)
    fig.tight_layout()
    return fig
