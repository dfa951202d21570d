"""The persistent decode kernel (kernels/decode_persistent.cu) against the kernel-per-operation step (GPU only).

Both forms of a decode step compute the same numbers in the same order (the same splits, group
arithmetic, norm order and attention units), so these tests ask for bits: teacher-forced decode
steps after an odd-length prompt give equal logits either way, at the shapes where the family's
sizes differ, with attention cut into one page per split, several pages per split (the consumer
warps' merge) and one split for the whole sequence (no combine), eagerly and in the graph. The
multi-kernel step is itself held against the numpy oracle (tests/test_shapes_cuda.py, which runs
whichever form is the default, and tests/test_kernels_cuda.py).
"""

import numpy as np
import pytest

import nanoqwen
from nanoqwen.backends import cuda_available
from nanoqwen.testing import CHECKED_SHAPES, FAMILY_SHAPES, make_nanoqwen

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU"),
]

SHAPES = {**CHECKED_SHAPES,
          "7B widths, one layer": dict(num_layers=1, hidden_size=3584, intermediate_size=18944, num_heads=28,
                                       num_kv_heads=4, head_dim=128, vocab_size=2048)}
PAGES = 8
PROMPT_TOKENS = 77  # 4 full pages and 13 rows of a fifth
DECODE_STEPS = 20  # to position 96: into a seventh page
# The decode attention's splits of the 97 positions: the default (one page per split at this
# context), 4 (more pages than splits: runs of 3-4 pages for half of them, whose consumer warps
# merge) and 1 (the whole sequence in one split: no combine).
ATTENTION_SPLITS = {"one page per split": None, "runs of pages": 4, "one split": 1}


def run(backend, prompt, pages, tokens):
    """The logits of a prefill of `prompt`, then of decode steps fed `tokens` (or their own argmax)."""
    logits = [backend.prefill(prompt, 0, pages)]
    for step in range(DECODE_STEPS):
        token = tokens[step] if tokens else int(np.argmax(logits[-1]))
        logits.append(backend.decode(token, PROMPT_TOKENS + step, pages))
    return np.stack(logits)


def backend_for(path, splits):
    from nanoqwen.cuda.attention import PagedAttention
    from nanoqwen.cuda.backend import CudaBackend

    factory = None if splits is None else (lambda config, pages, length: PagedAttention(config, pages, length, splits))
    return CudaBackend(nanoqwen.load(path), PAGES, attention_factory=factory)


CASES = [(name, "one page per split") for name in SHAPES] + [
    (name, splits) for name in ("7B widths, one layer", "8:1 over 16 query heads") for splits in list(ATTENTION_SPLITS)[1:]]


@pytest.mark.parametrize("name, splits", CASES)
def test_persistent_layers_are_the_kernel_per_operation_bits(name, splits, tmp_path):
    path = make_nanoqwen(tmp_path, tokenizer=False, seed=len(name), **SHAPES[name])
    backend = backend_for(path, ATTENTION_SPLITS[splits])
    vocab, pages = backend.config.vocab_size, np.arange(PAGES, dtype=np.int32)
    prompt = np.random.default_rng(len(name) + len(splits)).integers(0, vocab, PROMPT_TOKENS).astype(np.int32)
    backend.persistent, backend.use_graph = False, True
    want = run(backend, prompt, pages, None)
    tokens = [int(t) for t in np.argmax(want[:-1], axis=1)]
    for use_graph in (False, True):
        backend.persistent, backend.use_graph = True, use_graph
        got = run(backend, prompt, pages, tokens)
        assert np.all(np.isfinite(got))
        differing = np.flatnonzero(np.any(got != want, axis=1))
        assert differing.size == 0, (f"graph={use_graph}: steps {differing.tolist()} differ, by up to "
                                     f"{np.abs(got - want).max()}")
    layers = backend._persistent_layers
    assert not layers.done.any() and not layers.tile_arrivals.any(), "a step left its counters set"


def test_the_persistent_form_is_an_option(tmp_path):
    from nanoqwen.cuda.backend import CudaBackend

    path = make_nanoqwen(tmp_path, tokenizer=False, **FAMILY_SHAPES["1:1 (no grouping)"])
    backend = backend_for(path, None)
    assert not backend.persistent and backend.launches_per_token > 4  # a kernel per operation decodes by default
    backend.persistent = True
    assert backend.launches_per_token == 4
    assert CudaBackend(nanoqwen.load(path), PAGES, persistent=True).persistent
    with pytest.raises(ValueError, match="persistent"):
        CudaBackend(nanoqwen.load(path), PAGES, activations="int8").persistent = True
