"""Session 18 lab: argmax_select_next alone at the 7B's vocabulary, greedy and with the device's
filtered draw, on three kinds of logits; the script that gave results/sampled-select-h200.md's
kernel figures. Run once per tree:

    PYTHONPATH=<tree> python3 results/select-timing-session18-lab.py OUT.json

Each row: the median of 7 timings of 50 back-to-back launches (CUDA events), and the status word
the last launch left (2: the host is to draw).
"""
import json, sys
import numpy as np, cupy as cp
from nanoqwen.cuda import build
from nanoqwen.random_model import QWEN25_CODER_7B
from nanoqwen.cuda.backend import ARGMAX_THREADS, NULL, sampler_settings
from nanoqwen.sampling import SamplingParams

c = QWEN25_CODER_7B
v = c.vocab_size
mod = build.compile_module(c)
select = mod.get_function("argmax_select_next")
rng = np.random.default_rng(0)
rows = []
for kind in ("normal*3", "peaked", "ties"):
    logits = (rng.standard_normal(v) * 3).astype(np.float32)
    if kind == "peaked":
        logits = (rng.standard_normal(v) * 2 - 8).astype(np.float32)
        logits[rng.integers(0, v, 30)] += 15
    if kind == "ties":
        logits = (rng.integers(-12, 1, v) / 4).astype(np.float32)
    best = int(np.argmax(logits))
    values, indices = cp.asarray([logits[best]], dtype=cp.float32), cp.asarray([best], dtype=cp.int32)
    d_logits = cp.asarray(logits)
    for name, params in [("greedy", None), ("k1", SamplingParams(temperature=0.7, top_k=1, seed=1)),
                         ("k40", SamplingParams(temperature=0.7, top_k=40, seed=1)),
                         ("k40p95", SamplingParams(temperature=0.7, top_k=40, top_p=0.95, seed=1)),
                         ("k1024", SamplingParams(temperature=0.7, top_k=1024, seed=1)),
                         ("k1024p95", SamplingParams(temperature=0.7, top_k=1024, top_p=0.95, seed=1)),
                         ("p95", SamplingParams(temperature=0.7, top_p=0.95, seed=1))]:
        try:
            sampler = NULL if params is None else cp.asarray(sampler_settings(params, v))
        except ValueError:  # a tree that draws this on the host
            continue
        state = cp.asarray([7, 100, 101, 0, 0], dtype=cp.int32)
        args = (values, indices, np.int32(1), state, NULL, np.int32(1), d_logits, sampler, NULL)  # no copy handed back
        for _ in range(5):
            select((1,), (ARGMAX_THREADS,), args)
        times = []
        for r in range(7):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            for _ in range(50):
                select((1,), (ARGMAX_THREADS,), args)
            b.record(); b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / 50)
        status = int(state[3].get())
        rows.append({"logits": kind, "sampler": name, "us": float(np.median(times)), "status": status})
        print(f"{kind:9s} {name:9s} {np.median(times):8.1f} us  status {status}", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
