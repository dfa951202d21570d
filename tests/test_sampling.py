"""Sampling: argument checks, the noise, the filters, reproducibility, and the distribution it draws from."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoqwen.sampling import MAX_TEMPERATURE, SamplingParams, gumbel_noise, most_likely_first, nucleus, sample
from nanoqwen.errors import GenerationError

LOGITS = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="0.7"), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(temperature=MAX_TEMPERATURE * 2), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(seed=-5), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed=2**64), r"seed must be None or an integer in \[0, 2\*\*64\)"),
    (dict(seed=2**20000), "seed"),  # printing it would fail past 4,300 digits; the message cuts it
])
def test_nonsense_is_refused(kwargs, field):
    with pytest.raises(GenerationError, match=field):
        SamplingParams(**kwargs)


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    params = SamplingParams()
    assert params.greedy and sample(logits, params, 0) == int(np.argmax(logits))


def test_filters_that_leave_one_token_are_greedy():
    logits = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    for params in (SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6)):
        assert {sample(logits, params, position) for position in range(50)} == {int(np.argmax(logits))}


def frequencies(params: SamplingParams, draws: int = 20000) -> np.ndarray:
    """How often each token is drawn over `draws` consecutive positions of one seeded request."""
    counts = np.bincount([sample(LOGITS, params, position) for position in range(draws)], minlength=len(LOGITS))
    return counts / draws


def test_the_noise_is_standard_gumbel_and_fresh_at_every_step():
    ids = np.arange(200_000)
    g = gumbel_noise((1, 2), 5, ids)
    assert abs(g.mean() - np.euler_gamma) < 0.01 and abs(g.var() - np.pi**2 / 6) < 0.02
    u = np.sort(np.exp(-np.exp(-g)))  # the Gumbel CDF maps it back to uniform
    assert np.abs(u - (ids + 0.5) / len(ids)).max() < 0.005  # Kolmogorov-Smirnov distance
    others = [gumbel_noise((1, 2), 6, ids), gumbel_noise((1, 3), 5, ids), gumbel_noise((2, 2), 5, ids)]
    assert all(abs(np.corrcoef(g, other)[0, 1]) < 0.01 for other in others)
    assert np.array_equal(g, gumbel_noise((1, 2), 5, ids))


def test_the_noise_is_pinned():
    """kernels/sampler.cuh computes the same bits: a change here must change it too."""
    np.testing.assert_allclose(gumbel_noise((1, 2), 5, [0, 1, 151_935]),
                               [0.698971611093303, 1.298440846351032, -0.05934754962130213], rtol=1e-15)


def test_seeds_draw_from_the_softmax_at_one_position():
    counts = np.bincount([sample(LOGITS, SamplingParams(temperature=1.0, seed=seed), 7) for seed in range(20000)],
                         minlength=len(LOGITS))
    np.testing.assert_allclose(counts / 20000, [0.4, 0.3, 0.2, 0.1], atol=0.015)


def test_a_request_without_a_seed_gets_one():
    a, b = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)
    assert a.seed is not None and a.seed != b.seed
    assert SamplingParams().seed is None  # greedy draws nothing


def test_temperature_one_draws_from_the_softmax():
    np.testing.assert_allclose(frequencies(SamplingParams(temperature=1.0)), [0.4, 0.3, 0.2, 0.1], atol=0.015)


def test_temperature_sharpens_and_flattens():
    cold, hot = frequencies(SamplingParams(temperature=0.5)), frequencies(SamplingParams(temperature=4.0))
    expected_cold = np.array([0.4, 0.3, 0.2, 0.1]) ** 2 / np.sum(np.array([0.4, 0.3, 0.2, 0.1]) ** 2)
    np.testing.assert_allclose(cold, expected_cold, atol=0.015)
    assert hot.max() - hot.min() < 0.15


def test_top_k_and_top_p_renormalize_what_they_keep():
    np.testing.assert_allclose(frequencies(SamplingParams(temperature=1.0, top_k=2)), [4 / 7, 3 / 7, 0, 0], atol=0.015)
    # nucleus 0.5: 0.4 < 0.5, 0.4 + 0.3 >= 0.5, so the first two stay
    np.testing.assert_allclose(frequencies(SamplingParams(temperature=1.0, top_p=0.5)), [4 / 7, 3 / 7, 0, 0], atol=0.015)
    # nucleus 0.85: 0.9 is the first cumulative mass to reach it, so three stay
    np.testing.assert_allclose(frequencies(SamplingParams(temperature=1.0, top_p=0.85)), [4 / 9, 3 / 9, 2 / 9, 0], atol=0.015)


def test_masked_logits_are_never_drawn():
    logits = np.array([0.0, -np.inf, 0.0, -np.inf], np.float32)
    params = SamplingParams(temperature=1.0)
    assert {sample(logits, params, position) for position in range(200)} == {0, 2}


def test_seed_replays_the_same_draws():
    logits = np.random.default_rng(2).standard_normal(5000).astype(np.float32)

    def run(seed):
        params = SamplingParams(temperature=1.0, top_k=100, top_p=0.9, seed=seed)
        return [sample(logits, params, position) for position in range(30)]

    assert run(3) == run(3) and run(3) != run(4)


def test_nan_logits_raise():
    logits = np.array([0.0, np.nan, 1.0], np.float32)
    with pytest.raises(FloatingPointError):
        sample(logits, SamplingParams(), 0)
    with pytest.raises(FloatingPointError):
        sample(logits, SamplingParams(temperature=1.0), 0)


def test_tiny_temperature_is_greedy_without_overflow():
    logits = np.array([1.0, 3.0, 2.0, 2.999], np.float32)
    with np.errstate(invalid="raise"):  # an inf - inf on the way would be a NaN
        picks = {sample(logits, params, position) for params in (SamplingParams(temperature=1e-310),
                 SamplingParams(temperature=1e-310, top_k=3, top_p=0.5)) for position in range(20)}
    assert picks == {1}


def test_numpy_integer_arguments_become_python_numbers():
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.uint64(2), top_p=np.float16(1), seed=np.uint32(7))
    assert (type(params.temperature), type(params.top_k), type(params.top_p), type(params.seed)) == (float, int, float, int)
    assert params.top_k == 2 and params.seed == 7
    logits = np.array([0.0, 5.0, 4.9, -3.0])
    draws = [sample(logits, params, position) for position in range(5)]
    assert set(draws) <= {1, 2}
    for bad in (dict(top_k=np.int64(-1)), dict(seed=np.int8(-2)), dict(top_k=np.float64(2)), dict(seed=np.bool_(True))):
        with pytest.raises(GenerationError):
            SamplingParams(**bad)


def test_fp16_and_huge_integer_settings_are_checked_without_numpy_warnings():
    """The bound 1e30 is compared as a Python float: cast to fp16 it would overflow, with a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SamplingParams(temperature=np.float16(1)).temperature == 1.0
        for bad in (dict(temperature=np.float16("inf")), dict(temperature=10**400), dict(top_p=10**400)):
            with pytest.raises(GenerationError):
                SamplingParams(**bad)


def test_infinite_logits_raise():
    with pytest.raises(FloatingPointError):
        sample(np.array([0.0, np.inf]), SamplingParams(temperature=0.7), 0)
    with pytest.raises(FloatingPointError):
        sample(np.array([-np.inf, -np.inf]), SamplingParams(temperature=0.7), 0)


def full_sort(scaled: np.ndarray) -> np.ndarray:
    """Every id, most likely first, ties in id order: what the filters are defined by."""
    return np.argsort(-scaled, kind="stable")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-6, 0), min_size=1, max_size=300), st.integers(1, 320),
       st.floats(0.01, 0.999), st.integers(0, 3))
def test_the_filters_match_a_sort_of_the_whole_vocabulary(levels, k, top_p, masked):
    """Few distinct values, so ties at every boundary; some ids masked to -inf (weight 0)."""
    scaled = np.array(levels, dtype=np.float64) / 2
    scaled[: min(masked, len(scaled) - 1)] = -np.inf
    order = full_sort(scaled)
    k = min(k, len(scaled))
    assert np.array_equal(most_likely_first(scaled, None, k)[:k], order[:k])
    assert np.array_equal(most_likely_first(scaled, order[::-1].copy(), k)[:k], order[:k])  # any order of ids in
    mass = np.cumsum(np.exp(scaled[order]))
    shortest = min(int(np.searchsorted(mass, top_p * mass[-1])) + 1, len(order))
    got = nucleus(scaled, None, top_p)
    assert sorted(got) == sorted(order[: len(got)])  # the most likely, ties to the lower ids
    assert abs(len(got) - shortest) <= 1  # the same cut, but where rounding puts a sum on the boundary
    kept = order[:k]
    inner = nucleus(scaled, kept.copy(), top_p)
    assert sorted(inner) == sorted(kept[: len(inner)])


def test_the_nucleus_of_a_peaked_and_of_a_flat_distribution():
    scaled = np.full(100_000, -40.0)
    scaled[[7, 70_000, 123]] = [0.0, -0.5, -1.0]  # nearly all the mass in three ids: a short head
    assert nucleus(scaled, None, 0.9).tolist() == [7, 70_000, 123]
    flat = np.zeros(1000)  # all tied: the nucleus is the lowest ids
    assert sorted(nucleus(flat, None, 0.5)) == list(range(500))
    rng = np.random.default_rng(0)
    wide = rng.standard_normal(50_000) * 0.1  # the run covers most of the vocabulary
    order = np.argsort(-wide, kind="stable")
    got = nucleus(wide, None, 0.95)
    assert len(got) > 40_000 and sorted(got) == sorted(order[: len(got)])


def test_which_draws_the_cuda_backend_makes_on_the_device():
    """Greedy, temperature, a top-k of at most TOP_K_MAX (with or without top-p) and a top-p alone
    run in the decode graph; a larger top-k brings the logits to the host, and a top-p alone may
    hand a step's draw back (its run may be longer than the TOP_K_MAX tokens the device keeps). The
    settings' words are the layout of kernels/sampler.cuh's SamplerSettings."""
    from nanoqwen.cuda.abi import TOP_K_MAX
    from nanoqwen.cuda.sampler import device_top_k, may_hand_back, sampler_settings

    vocab = 5000
    assert device_top_k(SamplingParams(), vocab) == 0
    assert device_top_k(SamplingParams(temperature=0.7), vocab) == 0
    assert device_top_k(SamplingParams(temperature=0.7, top_k=40, top_p=0.9), vocab) == 40
    assert device_top_k(SamplingParams(temperature=0.7, top_k=TOP_K_MAX), vocab) == TOP_K_MAX
    assert device_top_k(SamplingParams(temperature=0.7, top_k=vocab), vocab) == 0  # sample() ignores k >= vocab
    for top_p_alone in (dict(top_p=0.9), dict(top_k=vocab, top_p=0.5)):
        params = SamplingParams(temperature=0.7, **top_p_alone)
        assert device_top_k(params, vocab) == TOP_K_MAX and may_hand_back(params, vocab)
        assert device_top_k(params, 1000) == 1000 and not may_hand_back(params, 1000)  # it keeps every token
        assert sampler_settings(params, vocab)[5] == 1  # nucleus_of_all
    assert not may_hand_back(SamplingParams(temperature=0.7, top_k=40, top_p=0.9), vocab)
    assert not may_hand_back(SamplingParams(top_p=0.9), vocab)  # greedy ignores the filters
    assert device_top_k(SamplingParams(temperature=0.7, top_k=TOP_K_MAX + 1), vocab) is None
    with pytest.raises(ValueError, match="host"):
        sampler_settings(SamplingParams(temperature=0.7, top_k=TOP_K_MAX + 1), vocab)
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=3)
    words = sampler_settings(params, vocab)
    assert words.dtype == np.uint32 and words.shape == (8,) and tuple(words[:2]) == params.key
    assert words[2:4].view(np.float64)[0] == 0.7 and words[4] == 40 and words[6:8].view(np.float64)[0] == 0.9
    assert words[5] == 0  # the top-p weighs the 40 kept
    assert not sampler_settings(SamplingParams(), vocab).any()  # greedy: all zero
