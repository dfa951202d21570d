"""Prompt-lookup drafting: the incremental index drafts what a scan of the context finds, and a
verify pass accepts its chosen tokens up to the first that differs from its draft."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoqwen.sampling import GREEDY, SamplingParams, sample
from nanoqwen.speculative import PromptLookup, accepted_tokens


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
