"""Speculative decoding: prompt-lookup drafts and the numpy verify pass.

A verify pass multiplies several rows at once where a decode step multiplies one, so its logits
may round differently in the last bits: a last-bit difference can move an fp16 activation by an
ulp, as a prefill in chunks differs from one call (test_engine_numpy.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nanoqwen
from nanoqwen.cli import DEFAULT_MODEL
from nanoqwen.engine import Engine
from nanoqwen.kvcache import PAGE_SIZE
from nanoqwen.reference.backend import NumpyBackend
from nanoqwen.sampling import GREEDY, SamplingParams, sample
from nanoqwen.speculative import MAX_DRAFTS, PromptLookup, accepted_tokens
from nanoqwen.testing import make_nanoqwen

# pytest puts tests/ on sys.path: the fp16-rounding tolerance and the random models are reused.
from test_engine_numpy import CONFIGS, tolerance  # noqa: E402


# ---- drafting ----


def brute_force_draft(tokens: list[int], count: int, max_ngram: int, min_ngram: int) -> list[int]:
    """PromptLookup.draft by scanning the whole context: the definition it must agree with."""
    for n in range(min(max_ngram, len(tokens)), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - 1, n - 1, -1):  # the token after an earlier occurrence
            if tokens[start - n : start] == suffix:
                extended = list(tokens)
                while len(extended) < len(tokens) + count:
                    extended.append(extended[start + len(extended) - len(tokens)])
                return extended[len(tokens) :]
    return []


def test_draft_follows_the_latest_occurrence_of_the_longest_match():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    tokens = [7, 1, 2, 3, 8, 4, 2, 3, 9, 6, 7, 1, 2, 3]
    lookup = PromptLookup(tokens)
    assert lookup.draft(3) == [8, 4, 2]  # 7 1 2 3 at 0..3 beats the later 2 3 at 6..7
    assert PromptLookup(tokens, max_ngram=2).draft(2) == [9, 6]  # of 2 3, the latest earlier one
    lookup.extend([5])
    assert lookup.draft(4) == []  # 5 occurred nowhere before
    lookup.extend([1])
    assert lookup.draft(2) == [2, 3]  # the 1-gram 1: latest at 11
    assert PromptLookup(tokens + [5, 1], min_ngram=2).draft(2) == []  # 5 1 never occurred
    assert lookup.draft(0) == [] and PromptLookup([]).draft(3) == [] and PromptLookup([4]).draft(3) == []


def test_a_match_at_the_end_continues_itself():
    assert PromptLookup([1, 2, 1, 2]).draft(5) == [1, 2, 1, 2, 1]
    assert PromptLookup([3, 7, 7, 7]).draft(4) == [7, 7, 7, 7]


def test_lookup_arguments():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup([1], max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup([1], min_ngram=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(1, 5), max_size=20),
       st.integers(1, 5), st.integers(1, 4), st.integers(1, 3))
def test_incremental_index_drafts_what_a_scan_finds(tokens, chunks, count, max_ngram, min_ngram):
    min_ngram = min(min_ngram, max_ngram)
    lookup = PromptLookup(tokens[:5], max_ngram, min_ngram)
    done = 5
    for size in [*chunks, len(tokens)]:  # extended in pieces, as passes accept tokens
        assert lookup.draft(count) == brute_force_draft(tokens[:done], count, max_ngram, min_ngram)
        lookup.extend(tokens[done : done + size])
        done += size
    assert lookup.tokens == tokens


def test_accepted_tokens_stop_at_the_first_disagreement():
    def rows(*tokens):
        logits = np.full((len(tokens), 10), -1.0, dtype=np.float32)
        logits[np.arange(len(tokens)), tokens] = 1.0
        return logits

    assert accepted_tokens(rows(4, 5, 6), [4, 5], GREEDY, 0) == [4, 5, 6]  # every draft, and one more
    assert accepted_tokens(rows(4, 9, 6), [4, 5], GREEDY, 0) == [4, 9]  # 9 is right where 5 was not
    assert accepted_tokens(rows(3, 5, 6), [4, 5], GREEDY, 0) == [3]
    assert accepted_tokens(rows(2), [], GREEDY, 0) == [2]
    after_a_miss = rows(3, 5, 6)
    after_a_miss[1:] = np.nan  # rows computed from a wrong draft are never sampled
    assert accepted_tokens(after_a_miss, [4, 5], GREEDY, 0) == [3]
    sampled = SamplingParams(temperature=0.8, seed=3)
    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)
    chosen = [sample(row, sampled, 17 + j) for j, row in enumerate(logits)]  # row j at position 17 + j
    assert accepted_tokens(logits, chosen[:3], sampled, 17) == chosen


# ---- the numpy verify pass ----


@pytest.fixture(scope="module")
def coder():
    return Engine(nanoqwen.load(DEFAULT_MODEL), backend="numpy")


# test_engine_numpy's random models but the largest (gqa7-28x4, whose 7:1 grouping gqa7-7x1 has too)
RANDOM_MODELS = ("default-gqa2", "gqa7-7x1-d128-tied", "mha-3layers-tied-theta1e6")


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative_models")
    return {name: nanoqwen.load(make_nanoqwen(root / name, seed=CONFIGS[name][0], **CONFIGS[name][2]))
            for name in RANDOM_MODELS}


@pytest.mark.parametrize("which", ["nano-coder", "default-gqa2"])
def test_verify_rows_are_decode_steps(coder, random_models, which):
    model = coder.model if which == "nano-coder" else random_models[which]
    backend = NumpyBackend(model, num_pages=8)
    backend.kv_pool[...] = np.nan  # a read of a row nobody wrote shows up as NaN
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, 29)
    rows = rng.integers(0, model.config.vocab_size, 9).tolist()  # positions 29..37 cross into page 2
    stepped, verified = np.array([0, 1, 2], np.int32), np.array([5, 3, 7], np.int32)
    backend.prefill(prompt, 0, stepped)
    backend.prefill(prompt, 0, verified)
    steps = np.array([backend.decode(token, 29 + j, stepped) for j, token in enumerate(rows)])
    logits = backend.verify_logits(rows[0], rows[1:], 29, verified)
    assert logits.shape == (9, model.config.vocab_size) and np.isfinite(logits).all()
    # Not bit-identical: a [9, K] product sums in another order than [1, K], and a last-bit
    # difference can move an fp16 activation by an ulp (measured: up to 0.012 on logits of rms 5).
    np.testing.assert_allclose(logits, steps, rtol=0, atol=tolerance(model.config, steps))
    # What it accepts: drafts that are decode's greedy chain are all taken, with one token more;
    # a wrong draft ends the run with the token decode chooses there.
    chain = [rows[0]]
    for j in range(5):
        chain.append(int(np.argmax(backend.decode(chain[-1], 29 + j, stepped))))
    assert backend.verify(rows[0], chain[1:5], 29, verified) == chain[1:6]
    wrong = (chain[3] + 1) % model.config.vocab_size
    assert backend.verify(rows[0], [chain[1], wrong, chain[3]], 29, verified) == chain[1:3]


def test_verify_checks_its_inputs(coder):
    backend = coder.backend
    with pytest.raises(ValueError, match="page table"):
        backend.verify(1, [2, 3], PAGE_SIZE - 2, np.array([0], np.int32))  # row 16 needs a 2nd page
    with pytest.raises(ValueError, match="at most 16 drafts"):
        backend.verify(1, [2] * (MAX_DRAFTS + 1), 0, np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="token ids"):
        backend.verify(1, [coder.config.vocab_size], 0, np.array([0], np.int32))
