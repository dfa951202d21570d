"""Session 17 lab: decode ms/token of `Engine.generate` at the 7B's shapes, greedy and sampled, for
the tree on PYTHONPATH. Run once per tree, alternating trees, each in its own process:

    PYTHONPATH=<tree> python3 results/sampled-decode-session17-lab.py LABEL OUT.json /tmp/q7b.nanoqwen [greedy]

With `greedy` last, only the greedy row, five runs instead of three.
"""
import json
import statistics
import sys

import numpy as np

from nanoqwen.engine import Engine

SETTINGS = {"greedy": {}, "temperature 0.7": dict(temperature=0.7),
            "temperature 0.7, top-k 40": dict(temperature=0.7, top_k=40),
            "temperature 0.7, top-k 40, top-p 0.95": dict(temperature=0.7, top_k=40, top_p=0.95),
            "temperature 0.7, top-p 0.95": dict(temperature=0.7, top_p=0.95)}
label, out, path = sys.argv[1:4]
greedy_only = sys.argv[4:] == ["greedy"]
if greedy_only:
    SETTINGS = {"greedy": {}}
engine = Engine(path, backend="cuda", max_context=512 + 128)
ids = np.random.default_rng(0).integers(0, min(engine.config.vocab_size, 150000), 512).tolist()
engine.generate(ids[:32], max_new_tokens=8, stop_token_ids=[])  # graph capture, first launches
rows = {}
for name, settings in SETTINGS.items():
    runs = [engine.generate(ids, max_new_tokens=128, stop_token_ids=[], **settings, **({"seed": r} if settings else {}))
            for r in range(5 if greedy_only else 3)]
    rows[name] = 1e3 / statistics.median(r.decode_tokens_per_second for r in runs)
engine.close()
json.dump({"label": label, "model": path, "decode_ms_per_token": rows}, open(out, "w"), indent=1)
print(f"{label} | " + " | ".join(f"{k}: {v:.3f}" for k, v in rows.items()))
