"""Session 18 lab: decode ms/token of `Engine.generate` at the 7B's shapes, greedy and sampled, for
the tree on PYTHONPATH, and how many decode steps the host drew. Run once per tree, alternating
trees, each in its own process:

    PYTHONPATH=<tree> python3 results/sampled-decode-session18-lab.py LABEL OUT.json /tmp/q7b.nanoqwen

The random weights give flat logits, on which a top-p of 0.95 alone runs past the 1,024 tokens the
device keeps at every step; at temperature 0.05 the same top-p ends among them. Session 19 added
temperatures between, where some steps run past them and some do not.
"""
import json
import statistics
import sys

import numpy as np

from nanoqwen.engine import Engine

SETTINGS = {"greedy": {}, "temperature 0.7": dict(temperature=0.7),
            "temperature 0.7, top-k 40": dict(temperature=0.7, top_k=40),
            "temperature 0.7, top-k 40, top-p 0.95": dict(temperature=0.7, top_k=40, top_p=0.95),
            "temperature 0.7, top-p 0.95": dict(temperature=0.7, top_p=0.95),
            "temperature 0.05, top-p 0.95": dict(temperature=0.05, top_p=0.95),
            # since session 19: temperatures between, where some steps hand their draw back
            **{f"temperature {t}, top-p 0.95": dict(temperature=t, top_p=0.95) for t in (0.1, 0.2, 0.3)}}
label, out, path = sys.argv[1:4]
engine = Engine(path, backend="cuda", max_context=512 + 128)
ids = np.random.default_rng(0).integers(0, min(engine.config.vocab_size, 150000), 512).tolist()
engine.generate(ids[:32], max_new_tokens=8, stop_token_ids=[])  # graph capture, first launches
rows, host_draws = {}, {}
for name, settings in SETTINGS.items():
    before = getattr(engine.backend, "host_draws", None)
    runs = [engine.generate(ids, max_new_tokens=128, stop_token_ids=[], **settings, **({"seed": r} if settings else {}))
            for r in range(3)]
    rows[name] = 1e3 / statistics.median(r.decode_tokens_per_second for r in runs)
    if before is not None:
        host_draws[name] = engine.backend.host_draws - before
engine.close()
json.dump({"label": label, "model": path, "decode_ms_per_token": rows, "host_draws_of_381_steps": host_draws},
          open(out, "w"), indent=1)
print(f"{label} | " + " | ".join(f"{k}: {v:.3f}" for k, v in rows.items()), host_draws)
