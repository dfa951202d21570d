"""The CUDA engine against the NumPy backend at the Qwen2 family's shapes and beyond (GPU only).

The published sizes differ in more than their widths (nanoqwen.testing.FAMILY_SHAPES), and the converter
accepts shapes none of them has (ACCEPTED_SHAPES: head_dim 96, queries wider or narrower than hidden). Each case
is a small model with that feature, on `nanoqwen.testing`'s weights (clear top-1 margins), run
teacher-forced through prefill (an odd prompt length, so the last page is partly filled) and
decode steps that cross a page boundary; both backends follow the same numerics contract, so their
logits differ by summation order and the fp16 rounding of prefill's weights only.
"""

import numpy as np
import pytest

from nanoqwen import Engine
from nanoqwen.backends import cuda_available
from nanoqwen.testing import CHECKED_SHAPES, make_nanoqwen

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU"),
]

PROMPT_TOKENS = 21  # one full page and 5 rows of the next
DECODE_STEPS = 14  # up to position 34: into a third page
# Rounding moves the logits by ~1e-3 of their norm; a wrong index, page or split moves them by O(1).
MAX_RELATIVE_ERROR = 1e-2


@pytest.mark.parametrize("name", CHECKED_SHAPES)
def test_cuda_logits_follow_numpy(name, tmp_path):
    path = make_nanoqwen(tmp_path, tokenizer=False, seed=len(name), **CHECKED_SHAPES[name])
    prompt = np.random.default_rng(1).integers(0, 512, PROMPT_TOKENS).astype(np.int32)
    tokens, runs = None, {}
    for backend in ("numpy", "cuda"):  # numpy first: its tokens feed both (teacher forcing)
        with Engine(path, backend=backend, max_context=64) as engine:
            pages = engine.allocator.allocate(3)
            logits = [engine.backend.prefill(prompt, 0, pages)]
            for step in range(DECODE_STEPS):
                token = tokens[step] if tokens else int(np.argmax(logits[-1]))
                logits.append(engine.backend.decode(token, PROMPT_TOKENS + step, pages))
            runs[backend] = np.stack(logits)
            tokens = tokens or [int(t) for t in np.argmax(runs[backend][:-1], axis=1)]
    want, got = runs["numpy"], runs["cuda"]
    assert np.all(np.isfinite(got))
    relative = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    assert relative.max() < MAX_RELATIVE_ERROR, relative
    assert np.array_equal(np.argmax(got, axis=1), np.argmax(want, axis=1))
