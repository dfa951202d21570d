"""The CUDA verify pass (kernels/verify.cu) against the CUDA decode step it must equal (GPU only).

A verify pass's row j is decode's step at position + j, computed by the same arithmetic in the
same order, so these tests ask for bits, not tolerances: the rows' logits equal the logits of
decode steps fed the same tokens, at the shapes where the multi-row GEMVs split their groups
unevenly, with GQA groups of 1 to 8, tied and separate lm_heads, 1 to 17 rows, and rows that
cross page boundaries; and, within rounding, the numpy verify pass, the oracle. Then the engine: speculation on the CUDA backend makes plain decoding's
tokens, greedy and sampled (device draw and host draw), on nano-coder's edit prompt, where most
drafts are accepted, and on random weights, where most are rejected and their rows rewritten.
"""

import numpy as np
import pytest

import nanoqwen
from nanoqwen import Engine
from nanoqwen.backends import cuda_available
from nanoqwen.cli import DEFAULT_MODEL
from nanoqwen.sampling import GREEDY
from nanoqwen.cuda.abi import NARROW_ROWS
from nanoqwen.speculative import MAX_DRAFTS
from nanoqwen.testing import CODE_EDIT_PROMPTS, FAMILY_SHAPES, make_nanoqwen

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU"),
]

# The family's features (vocab 1003 in one of them: not a multiple of 4), and the 7B's widths.
SHAPES = {**FAMILY_SHAPES,
          "1:1, vocab 1003": {**FAMILY_SHAPES["1:1 (no grouping)"], "vocab_size": 1003},
          "7B widths, one layer": dict(num_layers=1, hidden_size=3584, intermediate_size=18944, num_heads=28,
                                       num_kv_heads=4, head_dim=128, vocab_size=2048)}
PROMPT_TOKENS = 21  # a full page and 5 rows of the next: the pass's rows cross into a third page


# 1 to 8 rows run the narrow kernels, 9 and more the wide ones (kernels/verify.cu).
ROWS = [1, 2, 5, NARROW_ROWS, NARROW_ROWS + 1, MAX_DRAFTS + 1]


# Rounding moves the logits by ~1e-3 of their norm; a wrong row, position or page by O(1)
# (tests/test_shapes_cuda.py's bound for decode against numpy).
MAX_RELATIVE_ERROR = 1e-2


@pytest.mark.parametrize("name", SHAPES)
def test_verify_rows_are_decode_steps_bit_for_bit(name, tmp_path):
    """Each row against the CUDA decode step at its position (bits), and against the numpy verify
    pass, the oracle (within rounding), on fresh random prompts and rows."""
    path = make_nanoqwen(tmp_path, tokenizer=False, seed=len(name), **SHAPES[name])
    cases = {}
    for rows in ROWS:
        rng = np.random.default_rng(rows)
        vocab = nanoqwen.load(path).config.vocab_size
        cases[rows] = rng.integers(0, vocab, PROMPT_TOKENS).astype(np.int32), rng.integers(0, vocab, rows).tolist()
    oracle = {}
    with Engine(path, backend="numpy", max_context=64) as engine:
        pages = engine.allocator.allocate(3)
        for rows, (prompt, row_tokens) in cases.items():
            engine.backend.prefill(prompt, 0, pages)
            oracle[rows] = engine.backend.verify_logits(row_tokens[0], row_tokens[1:], PROMPT_TOKENS, pages)
    with Engine(path, backend="cuda", max_context=64) as engine:
        backend, pages = engine.backend, engine.allocator.allocate(3)
        for rows, (prompt, row_tokens) in cases.items():
            backend.prefill(prompt, 0, pages)
            verified = backend.verify_logits(row_tokens[0], row_tokens[1:], PROMPT_TOKENS, pages)
            # The decode steps write the same K/V rows again; equal bits leave the cache as it was.
            decoded = np.stack([backend.decode(token, PROMPT_TOKENS + j, pages) for j, token in enumerate(row_tokens)])
            assert np.all(np.isfinite(verified))
            mismatched = np.flatnonzero(np.any(verified != decoded, axis=1))
            assert mismatched.size == 0, (f"{rows} rows: rows {mismatched.tolist()} differ; largest difference "
                                          f"{np.abs(verified - decoded).max()}")
            want = oracle[rows]
            relative = np.linalg.norm(verified - want, axis=1) / np.linalg.norm(want, axis=1)
            assert relative.max() < MAX_RELATIVE_ERROR, f"{rows} rows against numpy: {relative}"


def greedy_run(backend, prompt, pages, steps: int) -> list[int]:
    token = int(np.argmax(backend.prefill(prompt, 0, pages)))
    tokens = [token]
    for step in range(steps - 1):
        tokens.append(backend.decode_next(tokens[-1], len(prompt) + step, pages))
    return tokens


def test_verify_accepts_up_to_the_first_wrong_draft_and_the_next_pass_rewrites_its_rows(tmp_path):
    path = make_nanoqwen(tmp_path, tokenizer=False, seed=3, **SHAPES["5:1, hidden 640, MLP 1792, tied"])
    prompt = np.random.default_rng(4).integers(0, 512, PROMPT_TOKENS).astype(np.int32)
    with Engine(path, backend="cuda", max_context=64) as engine:
        backend, pages = engine.backend, engine.allocator.allocate(3)
        # The decode graph captured below keeps the attention's buffers: no verify pass may replace them.
        partials = backend.attention.partial_acc.data.ptr, backend.attention.partial_max_sum.data.ptr
        plain = greedy_run(backend, prompt, pages, 12)
        backend.prefill(prompt, 0, pages)
        # All drafts right: the pass makes every row's token, across the page boundary at 32.
        assert backend.verify(plain[0], plain[1:9], PROMPT_TOKENS, pages, GREEDY) == plain[1:10]
        backend.prefill(prompt, 0, pages)
        wrong = [*plain[1:4], (plain[4] + 1) % 512, *plain[5:9]]
        assert backend.verify(plain[0], wrong, PROMPT_TOKENS, pages, GREEDY) == plain[1:5]
        # The next pass starts at the first position not accepted and overwrites the stale rows.
        position = PROMPT_TOKENS + 4
        assert backend.verify(plain[4], plain[5:11], position, pages, GREEDY) == plain[5:12]
        assert (backend.attention.partial_acc.data.ptr, backend.attention.partial_max_sum.data.ptr) == partials
        assert greedy_run(backend, prompt, pages, 12) == plain  # the decode graph, after the verify passes


@pytest.fixture(scope="module")
def coder():
    with Engine(nanoqwen.load(DEFAULT_MODEL), backend="cuda") as engine:
        yield engine


EDIT_PROMPT = CODE_EDIT_PROMPTS["type hints"]
NEW_TOKENS = 40
SAMPLINGS = {"greedy": {}, "temperature": dict(temperature=0.8, seed=11),
             "top-k (host draw)": dict(temperature=0.8, top_k=5, seed=11)}


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_speculation_makes_plain_decodings_tokens_on_cuda(coder, sampling):
    kwargs = dict(max_new_tokens=NEW_TOKENS, stop_token_ids=[], **SAMPLINGS[sampling])
    plain = coder.generate(EDIT_PROMPT, **kwargs)
    for n in (1, 4, 8, MAX_DRAFTS):
        result = coder.generate(EDIT_PROMPT, speculate=n, **kwargs)
        assert result.token_ids == plain.token_ids, f"speculate={n}"
        assert result.decode_tokens == NEW_TOKENS - 1
    if sampling == "greedy":
        assert result.tokens_per_pass > 2, "the edit should copy its prompt"


def test_a_pipelined_run_stops_after_the_step_it_queued(tmp_path):
    """next_tokens keeps one step queued; a True sent in yields that step's token and starts none."""
    path = make_nanoqwen(tmp_path, tokenizer=False, seed=2, **SHAPES["1:1 (no grouping)"])
    prompt = np.random.default_rng(5).integers(0, 512, PROMPT_TOKENS).astype(np.int32)
    with Engine(path, backend="cuda", max_context=64) as engine:
        backend, pages = engine.backend, engine.allocator.allocate(3)
        plain = greedy_run(backend, prompt, pages, 8)
        backend.prefill(prompt, 0, pages)
        upcoming = backend.next_tokens(plain[0], PROMPT_TOKENS, pages, 7)
        assert [next(upcoming) for _ in range(3)] == plain[1:4]
        assert upcoming.send(True) == plain[4]  # the step queued behind the third
        with pytest.raises(StopIteration):
            next(upcoming)
        # The device is where the host thinks: a verify pass from there makes plain's tokens.
        assert backend.verify(plain[4], plain[5:7], PROMPT_TOKENS + 4, pages, GREEDY) == plain[5:8]


def test_random_weights_reject_drafts_and_still_match(tmp_path):
    path = make_nanoqwen(tmp_path, tokenizer=False, seed=8, **SHAPES["8:1 over 16 query heads"])
    motif = np.random.default_rng(9).integers(0, 512, 20).tolist()
    with Engine(path, backend="cuda", max_context=256) as engine:
        for sampling in ({}, dict(temperature=1.0, seed=5)):
            plain = engine.generate(motif * 3, max_new_tokens=48, stop_token_ids=[], **sampling)
            result = engine.generate(motif * 3, max_new_tokens=48, stop_token_ids=[], speculate=6, **sampling)
            assert result.token_ids == plain.token_ids
            assert result.drafted_tokens > result.accepted_drafts, "random weights should reject some drafts"
