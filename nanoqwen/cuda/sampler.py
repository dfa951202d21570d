"""The device sampler's side on the host: which requests the device draws, and its settings.

`argmax_select_next` (kernels/sampler.cu) draws greedy and sampled tokens from the lm_head's
candidates and, for a top-k of at most TOP_K_MAX (with or without top-p) or a top-p alone, from
the TOP_K_MAX most likely logits. The request's settings reach it as one device array
(`sampler_settings`); what it chose comes back as the head of the decode state (`token_of_head`).
"""

from __future__ import annotations

import numpy as np

from ..sampling import SamplingParams
from .abi import (
    STATE_STATUS,
    STATE_TOKEN,
    STATUS_HOST_DRAWS,
    STATUS_NOT_FINITE,
    TOP_K_MAX,
)


def check_finite(status: int) -> None:
    """FloatingPointError when a device status word says the argmax flagged the logits, as numpy's
    choice raises on them."""
    if status == STATUS_NOT_FINITE:
        raise FloatingPointError("logits are not finite (the device's argmax saw NaN or +inf, or only -inf)")


def token_of_head(head: np.ndarray) -> int | None:
    """The token in the head of the decode state (token, position, seq_len, status); None when the
    device left the draw to the host (STATUS_HOST_DRAWS); FloatingPointError when the device's
    argmax flagged the logits, as numpy's choice does."""
    check_finite(head[STATE_STATUS])
    if head[STATE_STATUS] == STATUS_HOST_DRAWS:
        return None
    return int(head[STATE_TOKEN])


def applied_top_k(sampling: SamplingParams, vocab_size: int) -> int:
    """The top-k that nanoqwen.sampling.sample applies (0: none; it ignores a k >= the vocabulary)."""
    return sampling.top_k if 0 < sampling.top_k < vocab_size else 0


def device_top_k(sampling: SamplingParams, vocab_size: int) -> int | None:
    """The top-k that the device applies for `sampling` (0: none), or None when the host must
    choose: a top-k above TOP_K_MAX. A top-p alone weighs every token; the device then keeps the
    TOP_K_MAX most likely, in which a peaked distribution's run ends (`may_hand_back` says when
    it may not)."""
    top_k = applied_top_k(sampling, vocab_size)
    if top_k == 0:
        return 0 if sampling.top_p == 1 else min(TOP_K_MAX, vocab_size)
    return top_k if top_k <= TOP_K_MAX else None


def nucleus_of_all(sampling: SamplingParams, vocab_size: int) -> bool:
    """Whether `sampling`'s top-p weighs every token (no top-k applies)."""
    return not sampling.greedy and sampling.top_p < 1 and applied_top_k(sampling, vocab_size) == 0


def may_hand_back(sampling: SamplingParams, vocab_size: int) -> bool:
    """Whether a step may leave its draw to the host (STATUS_HOST_DRAWS): a top-p alone over more
    tokens than the device keeps, whose run can be longer than those on a flat distribution."""
    return nucleus_of_all(sampling, vocab_size) and vocab_size > TOP_K_MAX


def sampler_settings(sampling: SamplingParams, vocab_size: int) -> np.ndarray:
    """kernels/sampler.cuh's SamplerSettings for `sampling`, as uint32 [8]: key0, key1, the
    temperature's float64 bits, top_k, nucleus_of_all, top_p's float64 bits (all zero: greedy)."""
    settings = np.zeros(8, dtype=np.uint32)
    if not sampling.greedy:
        top_k = device_top_k(sampling, vocab_size)
        if top_k is None:
            raise ValueError(f"{sampling} is drawn on the host (device_top_k)")
        settings[:2] = sampling.key
        settings[2:4].view(np.float64)[0] = sampling.temperature
        settings[4] = top_k
        settings[5] = nucleus_of_all(sampling, vocab_size)
        settings[6:8].view(np.float64)[0] = sampling.top_p
    return settings
