"""Time `argmax_select_next` alone at the 7B's vocabulary: greedy, and the device's filtered draw
(top-k, top-k with top-p, top-p alone) on three kinds of logits. Needs CuPy and a GPU.

    python3 tools/time_select.py OUT.json

Each row is the median of 7 timings of 50 launches (CUDA events), and the status word the last
launch left (2: the host is to draw). results/sampled-select-h200.md has the figures.
"""
import json
import sys

import cupy as cp
import numpy as np

from nanoqwen import cuda_build
from nanoqwen.backend_cuda import ARGMAX_THREADS, NULL, sampler_settings
from nanoqwen.random_model import QWEN25_CODER_7B
from nanoqwen.sampling import SamplingParams

FILTERS = {"greedy": None, "k1": dict(top_k=1), "k40": dict(top_k=40), "k40p95": dict(top_k=40, top_p=0.95),
           "k1024": dict(top_k=1024), "k1024p95": dict(top_k=1024, top_p=0.95), "p95": dict(top_p=0.95)}


def logits_of(kind: str, vocab: int, rng) -> np.ndarray:
    if kind == "normal*3":
        return (rng.standard_normal(vocab) * 3).astype(np.float32)
    if kind == "peaked":  # a few likely tokens far above the rest, as a trained model's
        logits = (rng.standard_normal(vocab) * 2 - 8).astype(np.float32)
        logits[rng.integers(0, vocab, 30)] += 15
        return logits
    return (rng.integers(-12, 1, vocab) / 4).astype(np.float32)  # "ties": 13 values


def main(out: str) -> None:
    vocab = QWEN25_CODER_7B.vocab_size
    select = cuda_build.compile_module(QWEN25_CODER_7B).get_function("argmax_select_next")
    rng = np.random.default_rng(0)
    rows = []
    for kind in ("normal*3", "peaked", "ties"):
        logits = logits_of(kind, vocab, rng)
        best = int(np.argmax(logits))
        values, indices = cp.asarray([logits[best]], dtype=cp.float32), cp.asarray([best], dtype=cp.int32)
        device_logits = cp.asarray(logits)
        for name, filters in FILTERS.items():
            try:
                sampler = NULL if filters is None else cp.asarray(
                    sampler_settings(SamplingParams(temperature=0.7, seed=1, **filters), vocab))
            except ValueError:  # a tree that draws this on the host
                continue
            state = cp.asarray([7, 100, 101, 0, 0], dtype=cp.int32)
            args = (values, indices, np.int32(1), state, NULL, np.int32(1), device_logits, sampler)
            for _ in range(5):
                select((1,), (ARGMAX_THREADS,), args)
            times = []
            for _ in range(7):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                for _ in range(50):
                    select((1,), (ARGMAX_THREADS,), args)
                end.record()
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / 50)
            rows.append({"logits": kind, "sampler": name, "us": float(np.median(times)), "status": int(state[3].get())})
            print(f"{kind:9s} {name:9s} {rows[-1]['us']:8.1f} us  status {rows[-1]['status']}", flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
