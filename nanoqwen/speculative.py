"""Prompt-lookup drafting and the acceptance rule of speculative decoding.

A decode step reads every weight to make one token, and the cost of that read hardly grows with
the number of rows it multiplies. When a coding assistant edits code, much of what it writes
copies its prompt, so the next tokens can be guessed by looking the last few tokens up in the
text so far and proposing what followed them there (*prompt lookup*). One pass over the weights
then checks all the guesses: rows [token, *drafts] at consecutive positions, each row's token
chosen exactly as plain decoding would choose it at that position (`accepted_tokens`). Every
chosen token up to the first that differs from its draft is right, so a pass yields 1 to
len(drafts) + 1 tokens, and the output is the plain output, token for token.

`PromptLookup` keeps, for each n-gram length, a dict from n-gram to the position of the token
that followed its latest occurrence, updated as tokens are accepted: a draft costs one dict
lookup per length tried and a copy of the tokens it proposes, never a scan of the context.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .sampling import SamplingParams, sample

__all__ = ["MAX_DRAFTS", "MAX_NGRAM", "MIN_NGRAM", "DraftSchedule", "PromptLookup", "accepted_tokens"]

# The most drafts one pass verifies: a backend may size its verify buffers (MAX_DRAFTS + 1 rows)
# when it starts. Longer runs are rarely all right, and a rejected draft still costs its row.
MAX_DRAFTS = 16
# The longest n-gram looked up first. A longer match says more surely where in the text the
# output is copying from, where two tokens may match an unrelated place; on nano-coder's
# copy-heavy prompts (8 drafts per pass) 3, 4 and 6 make the same passes, 2 up to 10% more.
MAX_NGRAM = 4
# The shortest n-gram that may propose drafts. Longer matches are tried first, so a single token
# drafts only where no longer suffix occurred before. Most such drafts are wrong (4 to 33% right
# on those prompts), yet without them (MIN_NGRAM 2) the prompts take up to 32% more passes, never
# fewer: a wrong draft costs one row of a pass that reads the weights anyway.
MIN_NGRAM = 1


class PromptLookup:
    """Drafts for the tokens after `tokens` (prompt + tokens made so far) by n-gram lookup.

    draft(count): the tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram (MAX_NGRAM down to MIN_NGRAM tokens) that occurred before, at most `count`;
    [] when none did. A match near the end of the context runs on into the drafted tokens, so a
    repeating pattern is drafted for the whole count.
    """

    def __init__(self, tokens: Iterable[int], max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # following[n - min_ngram][ngram] = index in `tokens` of the token after its latest occurrence
        self._following: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_ngram, max_ngram + 1)]
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append accepted tokens; each new token indexes the n-grams that end just before it."""
        for token in tokens:
            end = len(self.tokens)  # the new token's index: it follows the n-grams ending at end - 1
            for n, following in zip(range(self.min_ngram, self.max_ngram + 1), self._following):
                if end >= n:
                    following[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(token))

    def draft(self, count: int) -> list[int]:
        """Up to `count` tokens proposed to follow the context (see the class docstring)."""
        if count <= 0:
            return []
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            start = self._following[n - self.min_ngram].get(tuple(tokens[-n:]))
            if start is not None:
                drafts = tokens[start : start + count]
                while len(drafts) < count:  # the match reaches the end: the copy continues itself
                    drafts.append(drafts[len(drafts) - (len(tokens) - start)])
                return drafts
        return []


# Auto mode: after this many verify passes in a row that accept none of their drafts, drafting
# pauses for a stretch of plain steps, FIRST_PAUSE tokens long and twice as long at each pause
# after it (at most LONGEST_PAUSE), until a pass accepts a draft again. On text with nothing to
# copy, a failed pass costs more than the step it replaces; the pauses bound what such passes cost.
# Edits fail a few passes in a row too (mostly single-token drafts): on nano-coder's edit prompts
# 3 failures in a row already pause them and cost up to a third of their tokens per pass, 8 none.
FAILURES_BEFORE_PAUSE = 8
FIRST_PAUSE, LONGEST_PAUSE = 16, 1024


class DraftSchedule:
    """How many drafts the next pass may verify (`allowed`): `speculate`, or 0 while drafting is
    paused after passes that kept failing. The engine reports each verify pass's accepted drafts
    (`verified`) and each plain step (`stepped`)."""

    def __init__(self, speculate: int):
        self.speculate = speculate
        self._failures = 0  # verify passes in a row that accepted no draft
        self._pause = 0  # plain steps left before drafting again
        self._next_pause = FIRST_PAUSE

    def allowed(self) -> int:
        return 0 if self._pause else self.speculate

    def verified(self, accepted: int) -> None:
        if accepted:
            self._failures, self._next_pause = 0, FIRST_PAUSE
            return
        self._failures += 1
        if self._failures >= FAILURES_BEFORE_PAUSE:
            self._failures, self._pause = 0, self._next_pause
            self._next_pause = min(2 * self._next_pause, LONGEST_PAUSE)

    def stepped(self) -> None:
        self._pause = max(0, self._pause - 1)


def accepted_tokens(logits: np.ndarray, drafts: Sequence[int], sampling: SamplingParams, position: int) -> list[int]:
    """The tokens a verify pass accepts, from the logits [len(drafts) + 1, vocab] of its rows.

    Row j ran at position + j, after the input token and drafts[:j]; its token is
    `sample(logits[j], sampling, position + j)`, the token plain decoding chooses there (the
    noise of a sampled draw depends only on seed, position and token id). The chosen tokens
    are accepted up to and including the first that differs from its draft: the rows after it
    were computed from a wrong token. Rows after it are not sampled.
    """
    accepted = []
    for j, row in enumerate(logits):
        accepted.append(sample(row, sampling, position + j))
        if j == len(drafts) or accepted[-1] != drafts[j]:
            break
    return accepted
