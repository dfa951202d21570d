"""Session 16 lab (kept with its record, results/sampled-decode-h200.md): sampled decode ms/token and the
host's sample() time, for the tree on PYTHONPATH.

    PYTHONPATH=<tree> python3 results/sampled-decode-session16-lab.py LABEL OUT.json MODEL_7B NANO_CODER
"""
import json, statistics, sys, time
import numpy as np
from nanoqwen.engine import Engine
from nanoqwen.sampling import SamplingParams, sample

SETTINGS = {"temperature 0.7": dict(temperature=0.7), "temperature 0.7, top-k 40": dict(temperature=0.7, top_k=40),
            "temperature 0.7, top-p 0.95": dict(temperature=0.7, top_p=0.95)}
label, out = sys.argv[1], sys.argv[2]
record = {"label": label, "models": {}}
for path, prompt_tokens in ((sys.argv[3], 512), (sys.argv[4], 256)):
    engine = Engine(path, backend="cuda", max_context=prompt_tokens + 128)
    ids = np.random.default_rng(0).integers(0, min(engine.config.vocab_size, 150000), prompt_tokens).tolist()
    engine.generate(ids[:32], max_new_tokens=8, stop_token_ids=[])
    rows = {"greedy": 1e3 / statistics.median(engine.generate(ids, max_new_tokens=128, stop_token_ids=[]).decode_tokens_per_second for _ in range(3))}
    for name, settings in SETTINGS.items():
        runs = [engine.generate(ids, max_new_tokens=128, stop_token_ids=[], seed=r, **settings) for r in range(3)]
        rows[name] = 1e3 / statistics.median(r.decode_tokens_per_second for r in runs)
    from nanoqwen.kvcache import pages_needed
    pages = engine.allocator.allocate(pages_needed(len(ids)))
    logits = engine.backend.prefill(np.array(ids, dtype=np.int32), 0, pages)
    engine.allocator.free(pages)
    host = {}
    for name, settings in SETTINGS.items():
        params = SamplingParams(**settings, seed=0); rng = params.rng()
        t = time.perf_counter()
        for _ in range(20):
            sample(logits, params, rng)
        host[name] = (time.perf_counter() - t) / 20 * 1e3
    record["models"][path] = {"decode_ms_per_token": rows, "host_sample_ms": host, "logits_std": float(np.std(logits))}
    engine.close()
    print(f"{label} | {path} | " + " | ".join(f"{k}: {v:.3f}" for k, v in rows.items()) + " || sample(): " +
          ", ".join(f"{v:.2f}" for v in host.values()) + f" ms | logits std {np.std(logits):.2f}")
json.dump(record, open(out, "w"), indent=1)
