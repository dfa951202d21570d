"""Under compute-sanitizer: argmax_select_next's filtered draw at the 7B's vocabulary and at 1003,
on the fast path (normal logits), the fallback (ties) and top-p alone (handed back or not); since
session 19 it also checks the logits a hand-back copies aside."""
import numpy as np, cupy as cp
from nanoqwen.cuda import build
from nanoqwen.config import ModelConfig
from nanoqwen.random_model import QWEN25_CODER_7B
from nanoqwen.cuda.backend import ARGMAX_THREADS, NULL, sampler_settings
from nanoqwen.sampling import SamplingParams, sample

ODD = ModelConfig(num_layers=2, hidden_size=384, intermediate_size=640, num_heads=6, num_kv_heads=2, head_dim=64,
                  vocab_size=1003, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
rng = np.random.default_rng(1)
bad = 0
for config in (QWEN25_CODER_7B, ODD):
    v = config.vocab_size
    select = build.compile_module(config).get_function("argmax_select_next")
    for kind in ("normal", "ties"):
        logits = (rng.standard_normal(v) * 3).astype(np.float32) if kind == "normal" else (rng.integers(-12, 1, v) / 4).astype(np.float32)
        for filters in (dict(top_k=40), dict(top_k=1000, top_p=0.9), dict(top_p=0.95), dict(top_p=0.3)):
            params = SamplingParams(temperature=0.8, seed=3, **filters)
            best = int(np.argmax(logits))
            state = cp.asarray([7, 100, 101, 0, 0], dtype=cp.int32)
            handed_back = cp.full((2, v), cp.nan, dtype=cp.float32)  # since session 19: row 100 % 2 on a hand-back
            select((1,), (ARGMAX_THREADS,), (cp.asarray([logits[best]]), cp.asarray([best], dtype=cp.int32), np.int32(1), state,
                                             NULL, np.int32(2), cp.asarray(logits), cp.asarray(sampler_settings(params, v)),
                                             handed_back))
            token, status = int(state[0].get()), int(state[3].get())
            want = sample(logits, params, 100)
            copies = handed_back.get()
            copied = status == 2 and np.array_equal(copies[0], logits) and np.isnan(copies[1]).all()
            ok = (copied or token == want) and (status == 2 or np.isnan(copies).all())
            bad += not ok
            print(v, kind, filters, "status", status, "ok" if ok else f"DIFFER {token} {want}")
print("bad", bad)
