"""Choosing the next token from a row of logits: greedy, temperature, top-k, top-p.

Every sampled draw is the Gumbel-max trick: the token whose logit plus temperature times a
Gumbel variable is largest, with one variable per token and step. It draws from the softmax at
that temperature exactly, needs no normalisation and no order of the tokens, and so it runs where
the logits are: in the CUDA backend's decode graph (kernels/lm_head.cu adds the noise to every
logit; kernels/sampler.cu applies a top-k of up to 1024 tokens, a top-p among them, or a top-p
alone whose run ends among the 1024 most likely, and draws), or here on the host, over the ids that top-k and top-p keep.

The variables come from a counter-based generator, a hash of (seed, position, token id), not from
a stateful one: both backends compute the same noise for the same step, a seed replays a run, and
the GPU needs no generator state. The host side works in float64 and rounds each key to float32
as the kernel does, so the backends choose alike whenever their logits agree to fp32 rounding.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from .errors import GenerationError, shown

__all__ = ["GREEDY", "SamplingParams", "gumbel_noise", "sample"]

# The largest temperature accepted. Each key is rounded to float32 (as the kernel's candidates
# are), and temperature * noise must stay far inside its range; a softmax at 1e30 is uniform anyway.
MAX_TEMPERATURE = 1e30
# A request's length when it names none (Engine.generate, and the CLI's --max-new-tokens).
DEFAULT_MAX_NEW_TOKENS = 256
# Seeds are 64-bit, as torch's and vLLM's are: a larger integer only costs time (its hash into the
# key) and cannot be printed past Python's 4,300 digits.
MAX_SEED = 2**64



def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _exact(x):
    """`x` as a number that compares with a Python float bound as written: numpy's floats as
    Python floats (numpy would cast the bound to x's type, and 1e30 overflows fp16), Python's
    integers as they are (any size compares exactly; float() of a huge one overflows)."""
    return float(x) if isinstance(x, np.floating) else x


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1 switch those filters off.

    A sampled request without a seed gets a random one here, so that every draw has a seed that
    replays it (`GenerationResult.seed` reports it).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)) or not 0 <= _exact(t) <= MAX_TEMPERATURE:
            raise GenerationError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {t!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0 (0 = no top-k filter), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)) or not 0 < _exact(p) <= 1:
            raise GenerationError(f"top_p must be a number in (0, 1] (1 = no nucleus filter), got {p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise GenerationError(f"seed must be None or an integer in [0, 2**64), got {shown(self.seed)}")
        # Plain Python numbers from here on: numpy's unsigned and fixed-width scalars overflow or
        # refuse mixed arithmetic (np.uint64(5) - 1 is a float64), Python's do neither.
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(p))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        elif self.temperature > 0:
            object.__setattr__(self, "seed", secrets.randbits(63))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Whether top-k or top-p restricts the draw: they need the tokens in order of probability."""
        return self.top_k > 0 or self.top_p < 1

    @cached_property
    def key(self) -> tuple[int, int]:
        """The generator's two 32-bit key words, from the seed by numpy's SeedSequence."""
        key0, key1 = np.random.SeedSequence(self.seed or 0).generate_state(2, np.uint32)
        return int(key0), int(key1)


GREEDY = SamplingParams()


def _mix32(x: np.ndarray) -> np.ndarray:
    """A bijective avalanche of uint32 words (the "lowbias32" constants of C. Wellons' hash
    prospector); kernels/sampler.cuh's mix32 is the same function."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x21F0AAAD)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x735A2D97)
    return x ^ (x >> np.uint32(15))


def gumbel_noise(key: tuple[int, int], position: int, ids: np.ndarray) -> np.ndarray:
    """float64 standard Gumbel variables for token `ids` at the step after `position`.

    Two hashes of (key, position, id) give 52 random bits, u = (bits + 1/2) / 2^52 lies strictly
    inside (0, 1) and exactly in float64, and -log(-log(u)) is Gumbel (|g| < 37). The kernel
    computes the same bits and the same float64 formula.
    """
    u32 = lambda v: np.array([v], dtype=np.uint32)  # arrays wrap on overflow; numpy's scalars warn  # noqa: E731
    step = _mix32(u32(key[1]) ^ _mix32(u32(key[0]) ^ _mix32(u32(position))))
    ids = np.asarray(ids, dtype=np.uint32)
    high = _mix32(_mix32(ids * np.uint32(2)) ^ step).astype(np.uint64)
    low = _mix32(_mix32(ids * np.uint32(2) + np.uint32(1)) ^ step).astype(np.uint64)
    bits = (high << np.uint64(20)) | (low >> np.uint64(12))
    u = (bits.astype(np.float64) + 0.5) * 2.0**-52
    return -np.log(-np.log(u))


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """One token id from `logits` [vocab], computed at `position`, under `params`.

    Greedy is the argmax. A sampled token is the argmax over the kept ids of
    float32(logit + temperature * gumbel_noise(seed, position, id)), ties to the lower id: the
    Gumbel-max trick, whose argmax is that of logit / temperature + noise, the textbook form,
    which overflows for a tiny temperature. Only the filters need an order by probability: top-k
    keeps the k most likely tokens, top-p the shortest run of most likely tokens whose mass
    reaches top_p; ties go to the lower id. Neither sorts the whole vocabulary, which cost 20 ms
    per token for 152k logits on a 2-core machine.
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
    kept = None  # every id
    if params.filtered:
        # The filters weigh tokens by probability. Subtract the max before dividing: every scaled
        # logit is then <= 0, so a tiny temperature (1e-310) sends the others to -inf, not the top
        # one to +inf (and inf - inf = NaN).
        scaled = logits - top
        with np.errstate(over="ignore"):
            scaled /= params.temperature
        if 0 < params.top_k < len(scaled):
            kept = most_likely_first(scaled, None, params.top_k)[: params.top_k]
        if params.top_p < 1:
            kept = nucleus(scaled, kept, params.top_p)
    ids = np.arange(len(logits)) if kept is None else kept
    keys = logits if kept is None else logits[kept]
    keys = (keys + params.temperature * gumbel_noise(params.key, position, ids)).astype(np.float32)
    best = np.flatnonzero(keys == keys.max())  # kept lists ids in any order: the lowest of tied keys
    return int(ids[best].min())


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
