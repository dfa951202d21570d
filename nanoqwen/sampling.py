"""Choosing the next token from a row of logits: greedy, temperature, top-k, top-p.

Sampling runs on the host in float64: the vocabulary is only ~152k entries, and doing it in
double precision makes a seeded run reproducible across backends (the backends agree on the
logits to fp32 rounding, and float64 arithmetic on top adds nothing platform-dependent). It
costs the decode loop about a millisecond per token: a few passes over the logits, and a sort
of only the most likely tokens when top-k or top-p asks for an order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["GenerationError", "SamplingParams", "sample"]


class GenerationError(ValueError):
    """A generation request the engine cannot serve; the message names the argument at fault.

    It lives here, the lowest module that raises it; `nanoqwen.GenerationError` is the same class.
    """


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)) or not math.isfinite(t) or t < 0:
            raise GenerationError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0 (0 = no top-k filter), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)) or not 0 < p <= 1:
            raise GenerationError(f"top_p must be a number in (0, 1] (1 = no nucleus filter), got {p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise GenerationError(f"seed must be None or an integer >= 0, got {self.seed!r}")
        # Plain Python numbers from here on: numpy's unsigned and fixed-width scalars overflow or
        # refuse mixed arithmetic (np.uint64(5) - 1 is a float64), Python's do neither.
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(p))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def rng(self) -> np.random.Generator:
        """A fresh generator per request: the same seed replays the same choices."""
        return np.random.default_rng(self.seed)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from `logits` [vocab] under `params`; greedy ignores `rng`.

    The draw is an inverse-CDF draw over the tokens the filters keep, in a fixed order, so a seed
    replays it. Only the filters need an order by probability: top-k keeps the k most likely
    tokens, top-p the shortest run of most likely tokens whose mass reaches top_p; ties go to the
    lower id. Neither needs a sort of token ids over the whole vocabulary, which cost 20 ms per
    token for 152k logits on a 2-core machine, a dozen decode steps of the 7B on an H200.
    """
    if params.greedy:
        best = int(np.argmax(logits))
        if not np.isfinite(logits[best]):  # argmax returns the first NaN if there is one
            raise FloatingPointError(f"logits are not finite (argmax hit {logits[best]})")
        return best
    logits = np.asarray(logits, dtype=np.float64)
    top = np.max(logits)  # NaN if any logit is NaN
    if not np.isfinite(top):
        raise FloatingPointError(f"logits hold NaN or +inf (max {top}): cannot sample")
    # Subtract the max before dividing: every scaled logit is then <= 0, so a tiny temperature
    # (1e-310) sends the others to -inf, not the top one to +inf (and inf - inf = NaN).
    scaled = logits - top
    with np.errstate(over="ignore"):
        scaled /= params.temperature
    kept = None  # every id, in id order
    if 0 < params.top_k < scaled.shape[0]:
        kept = most_likely_first(scaled, None, params.top_k)[: params.top_k]
    if params.top_p < 1:
        kept = nucleus(scaled, kept, params.top_p)
    weights = np.exp(scaled if kept is None else scaled[kept])  # the best weighs exp(0) = 1: no overflow
    cumulative = np.cumsum(weights)
    choice = min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")), len(weights) - 1)
    return choice if kept is None else int(kept[choice])


def most_likely_first(scaled: np.ndarray, ids: np.ndarray | None, count: int) -> np.ndarray:
    """At least the `count` ids of `ids` (None: every id) with the highest `scaled`, highest
    first, ties in id order.

    Every id tied with the count-th is included too, so that the order of the first `count` does
    not depend on which of equal values a partition happened to put in front.
    """
    values = scaled if ids is None else scaled[ids]
    if count < len(values):
        boundary = np.partition(values, len(values) - count)[len(values) - count]  # the count-th highest
        chosen = np.flatnonzero(values >= boundary)
        ids = chosen if ids is None else ids[chosen]
    elif ids is None:
        ids = np.arange(len(values))
    return ids[np.lexsort((ids, -scaled[ids]))]  # by value, descending, then by id


NUCLEUS_HEAD = 256  # ids sorted first in search of the nucleus


def nucleus(scaled: np.ndarray, ids: np.ndarray | None, top_p: float) -> np.ndarray:
    """The shortest run of `ids` (None: every id), most likely first and ties in id order, whose
    probability reaches `top_p` of their mass (at least one id), in no particular order. `ids`
    lists tied ids in increasing order (id order, or most_likely_first's).

    A peaked distribution has a short run: it sorts the most likely NUCLEUS_HEAD ids and finds it
    there. A flat one runs over much of the vocabulary: then one sort of the values alone gives
    the value where the run ends, and the run is every id above it and, of those tied with it,
    the lowest ids.
    """
    values = scaled if ids is None else scaled[ids]
    target = top_p * np.exp(values).sum()
    if NUCLEUS_HEAD < len(values):
        head = most_likely_first(scaled, ids, NUCLEUS_HEAD)
        mass = np.cumsum(np.exp(scaled[head]))
        if mass[-1] >= target:
            return head[: int(np.searchsorted(mass, target)) + 1]
    descending = np.sort(values)[::-1]
    mass = np.cumsum(np.exp(descending))
    length = min(int(np.searchsorted(mass, target)) + 1, len(values))
    last = descending[length - 1]
    above = np.flatnonzero(values > last)
    members = np.concatenate([above, np.flatnonzero(values == last)[: length - len(above)]])
    return members if ids is None else ids[members]
