"""Speculative decoding: prompt-lookup drafts, the numpy verify pass, and the engine's exactness.

Exactness means: with speculate=N the engine makes the tokens it makes without, token for
token, greedy or sampled. Each token is `sample(logits, sampling, position)` in both cases; what
may differ is the logits' rounding, since a verify pass multiplies several rows at once where a
decode step multiplies one, and a last-bit difference can move an fp16 activation by an ulp (as
a prefill in chunks differs from one call, test_engine_numpy.py). Two correct runs can then only
part at a near-tie, which the greedy checks below tell apart from a bug.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nanoqwen
from nanoqwen.cli import DEFAULT_MODEL
from nanoqwen.engine import Engine
from nanoqwen.errors import GenerationError
from nanoqwen.kvcache import PAGE_SIZE, pages_needed
from nanoqwen.reference.backend import NumpyBackend
from nanoqwen.sampling import GREEDY, SamplingParams, sample
from nanoqwen.speculative import (
    FAILURES_BEFORE_PAUSE, FIRST_PAUSE, LONGEST_PAUSE, MAX_DRAFTS, DraftSchedule, PromptLookup, accepted_tokens,
)
from nanoqwen.testing import CODE_EDIT_PROMPTS, make_nanoqwen

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


def test_drafting_pauses_after_passes_that_keep_failing():
    schedule = DraftSchedule(8)
    assert schedule.allowed() == 8
    pauses = []
    for _ in range(8):
        for _ in range(FAILURES_BEFORE_PAUSE - 1):
            schedule.verified(0)
            assert schedule.allowed() == 8
        schedule.verified(0)
        steps = 0
        while not schedule.allowed():
            schedule.stepped()
            steps += 1
        pauses.append(steps)
    assert pauses == [min(FIRST_PAUSE << i, LONGEST_PAUSE) for i in range(8)]
    schedule.verified(0)
    schedule.verified(3)  # a pass that accepts a draft resets both the count and the pause
    for _ in range(FAILURES_BEFORE_PAUSE):
        schedule.verified(0)
    steps = 0
    while not schedule.allowed():
        schedule.stepped()
        steps += 1
    assert steps == FIRST_PAUSE


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


# ---- the engine: the same tokens in fewer passes ----

# A code edit whose output copies its prompt: nano-coder writes Vector as a copy of Point.
EDIT_PROMPT = CODE_EDIT_PROMPTS["copy a class"]
# Real code that repeats itself (lines of BAD_REQUESTS in test_engine_numpy.py): nano-coder
# continues the pattern, so nearly every draft is right.
CASES_PROMPT = '''BAD_REQUESTS = [
    (dict(prompt=""), "empty"),
    (dict(prompt=[]), "empty"),
    (dict(prompt=[1, -1]), "outside the vocabulary"),
    (dict(prompt=[1, 512]), "outside the vocabulary"),
    (dict(prompt="x", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt="x", temperature=-1.0), "temperature"),
'''
NOTHING_TO_COPY = "Write a haiku"
NEW_TOKENS = 48


def recorded_passes(monkeypatch, engine) -> list[tuple[int, list[int], list[int]]]:
    """(position, drafts, accepted) of every verify pass `engine` runs from now on."""
    passes = []
    verify = engine.backend.verify

    def recording(token_id, drafts, position, page_table, sampling=GREEDY):
        accepted = verify(token_id, drafts, position, page_table, sampling)
        passes.append((position, list(drafts), accepted))
        return accepted

    monkeypatch.setattr(engine.backend, "verify", recording)
    return passes


def assert_same_tokens(engine, prompt_ids, plain: list[int], speculative: list[int]) -> None:
    """Equal, or a failure that says whether the first split is a near-tie of the plain path."""
    split = next((i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b), None)
    if split is None:
        assert len(plain) == len(speculative)
        return
    table = engine.allocator.allocate(pages_needed(len(prompt_ids) + split + 1))
    try:
        logits = engine.backend.prefill(np.array(prompt_ids), 0, table)
        for step, token in enumerate(plain[:split]):
            logits = engine.backend.decode(token, len(prompt_ids) + step, table)
    finally:
        engine.allocator.free(table)
    top2 = np.sort(logits)[-2:]
    pytest.fail(f"step {split}: plain {plain[split]}, speculative {speculative[split]} (plain top-2 margin "
                f"{top2[1] - top2[0]:.3g}; below ~0.02 it is a near-tie the two passes' rounding may split)")


@pytest.mark.parametrize("prompt", [EDIT_PROMPT, CASES_PROMPT, NOTHING_TO_COPY], ids=["edit", "cases", "no-copy"])
def test_greedy_speculation_makes_the_plain_tokens(coder, monkeypatch, prompt):
    plain = coder.generate(prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    assert plain.decode_passes == NEW_TOKENS - 1 and plain.tokens_per_pass == 1.0
    passes = recorded_passes(monkeypatch, coder)
    for n in (1, 4, MAX_DRAFTS):
        result = coder.generate(prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[], speculate=n)
        assert_same_tokens(coder, plain.prompt_token_ids, plain.token_ids, result.token_ids)
        assert result.text == plain.text and result.finish_reason == "length"
        assert result.decode_tokens == result.decode_passes + result.accepted_drafts == NEW_TOKENS - 1
        assert max((len(drafts) for _, drafts, _ in passes), default=0) <= n
    if prompt != NOTHING_TO_COPY:
        assert result.tokens_per_pass > 2.5, "the output should copy the prompt"
        # A run of accepted drafts crosses from one 16-token page into the next.
        assert any(position // PAGE_SIZE != (position + len(accepted) - 1) // PAGE_SIZE
                   for position, _, accepted in passes if len(accepted) > 2)


def running_ahead(monkeypatch, backend) -> list[int]:
    """Make `backend.next_tokens` compute each step before its consumer asks, as CudaBackend's
    queue does (the step after the one it yields is already done), honouring a True sent in
    (Backend.next_tokens); returns the list of positions of the steps it runs."""
    steps_run, decode_next = [], backend.decode_next

    def step(token, position, page_table, sampling):
        steps_run.append(position)
        return decode_next(token, position, page_table, sampling)

    def next_tokens(token_id, position, page_table, steps, sampling=GREEDY):
        ahead = step(token_id, position, page_table, sampling) if steps > 0 else None
        for k in range(steps):
            token = ahead
            ahead = step(token, position + k + 1, page_table, sampling) if k + 1 < steps else None
            if (yield token):
                if ahead is not None:
                    yield ahead
                return

    monkeypatch.setattr(backend, "next_tokens", next_tokens)
    return steps_run


@pytest.mark.parametrize("prompt", [EDIT_PROMPT, NOTHING_TO_COPY], ids=["edit", "no-copy"])
def test_plain_steps_between_passes_run_ahead_and_waste_nothing(coder, monkeypatch, prompt):
    """Without a draft the engine takes plain steps from next_tokens, which may run a step ahead;
    once the text drafts again, the step already running is read, never thrown away."""
    plain = coder.generate(prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[]).token_ids
    passes = recorded_passes(monkeypatch, coder)
    steps_run = running_ahead(monkeypatch, coder.backend)
    result = coder.generate(prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[], speculate=4)
    assert_same_tokens(coder, coder.encode_prompt(prompt), plain, result.token_ids)
    assert len(steps_run) == result.decode_passes - len(passes) > 0  # every step's token was used
    if prompt == EDIT_PROMPT:
        assert passes and result.tokens_per_pass > 2


def test_numpy_next_tokens_stops_at_once_when_told():
    """Nothing runs ahead on the numpy backend: a True sent in (Backend.next_tokens) ends the run."""
    engine = Engine(nanoqwen.load(DEFAULT_MODEL), backend="numpy")
    prompt = engine.encode_prompt(EDIT_PROMPT)
    table = engine.allocator.allocate(pages_needed(len(prompt) + 8))
    first = int(np.argmax(engine.backend.prefill(np.asarray(prompt), 0, table)))
    upcoming = engine.backend.next_tokens(first, len(prompt), table, 8)
    tokens = [next(upcoming), next(upcoming)]
    with pytest.raises(StopIteration):
        upcoming.send(True)
    plain = engine.generate(prompt, max_new_tokens=3, stop_token_ids=[]).token_ids
    assert [first, *tokens] == plain


def test_drafts_that_always_fail_pause_drafting(coder, monkeypatch):
    """With every draft wrong, verify passes come in runs of FAILURES_BEFORE_PAUSE between pauses
    of FIRST_PAUSE, 2 FIRST_PAUSE, ... plain steps, and the tokens stay plain decoding's."""
    new_tokens = 120
    plain = coder.generate(NOTHING_TO_COPY, max_new_tokens=new_tokens, stop_token_ids=[]).token_ids
    vocab = coder.config.vocab_size
    monkeypatch.setattr(PromptLookup, "draft", lambda self, count: [(self.tokens[-1] + 1) % vocab] * min(count, 2))
    passes = recorded_passes(monkeypatch, coder)
    result = coder.generate(NOTHING_TO_COPY, max_new_tokens=new_tokens, stop_token_ids=[], speculate=2)
    assert result.token_ids == plain
    # A wrong draft's pass makes one token, as a plain step does: runs of failed passes, then pauses.
    made, expected, pause = 0, 0, FIRST_PAUSE
    while made < new_tokens - 1:
        failed = min(FAILURES_BEFORE_PAUSE, new_tokens - 1 - made)
        expected, made = expected + failed, made + failed + pause
        pause *= 2
    assert len(passes) == expected and all(len(accepted) == 1 for _, _, accepted in passes)


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_random_models_reject_and_rewrite_rows_exactly(random_models, name):
    """Random models copy little: many passes reject a draft, and the next one overwrites its rows."""
    model = random_models[name]
    engine = Engine(model, backend="numpy")
    engine.backend.kv_pool[...] = np.nan
    motif = np.random.default_rng(CONFIGS[name][1]).integers(0, model.config.vocab_size, 20).tolist()
    rejected = 0
    for prompt in (motif * 3, motif):
        plain = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[], speculate=4)
        assert_same_tokens(engine, prompt, plain.token_ids, result.token_ids)
        rejected += result.drafted_tokens - result.accepted_drafts
    assert rejected > 0


def test_max_new_tokens_ends_inside_a_pass(coder, monkeypatch):
    plain = coder.generate(CASES_PROMPT, max_new_tokens=17, stop_token_ids=[]).token_ids
    prompt_len = len(coder.encode_prompt(CASES_PROMPT))
    passes = recorded_passes(monkeypatch, coder)
    for limit in (1, 2, 5, 17):
        passes.clear()
        result = coder.generate(CASES_PROMPT, max_new_tokens=limit, stop_token_ids=[], speculate=8)
        assert result.token_ids == plain[:limit] and result.finish_reason == "length"
        # The drafts shrink to what is left: no pass goes past the last row plain decoding writes.
        assert all(position + len(drafts) <= prompt_len + limit - 2 for position, drafts, _ in passes)
    assert any(len(drafts) < 8 for _, drafts, _ in passes)


def test_exact_fit_writes_no_row_past_plain_decoding(coder):
    prompt = coder.encode_prompt(CASES_PROMPT)
    limit = 2 * PAGE_SIZE + 5
    engine = Engine(coder.model, backend="numpy", max_context=len(prompt) + limit)
    engine.backend.kv_pool[...] = np.nan
    result = engine.generate(prompt, max_new_tokens=limit, stop_token_ids=[], speculate=MAX_DRAFTS)
    assert result.token_ids == coder.generate(prompt, max_new_tokens=limit, stop_token_ids=[]).token_ids
    assert result.tokens_per_pass > 2
    last = len(prompt) + limit - 2  # the position of the last token plain decoding feeds
    pages = pages_needed(len(prompt) + limit)  # a fresh engine's first table: pages 0, 1, ...
    kv = np.moveaxis(engine.backend.kv_pool[:, :pages], 4, 2)  # [L, pages, 16, 2, KVH, D]
    written = ~np.isnan(kv.reshape(kv.shape[0], pages * PAGE_SIZE, -1)).any(axis=(0, 2))  # [positions]
    assert written[: last + 1].all() and not written[last + 1 :].any()


def test_a_stop_token_inside_an_accepted_run(coder, monkeypatch):
    passes = recorded_passes(monkeypatch, coder)
    free_run = coder.generate(EDIT_PROMPT, max_new_tokens=NEW_TOKENS, stop_token_ids=[], speculate=8).token_ids
    prompt_len = len(coder.encode_prompt(EDIT_PROMPT))
    # A token first made in the middle of a pass's accepted run, not at its end.
    inside = next((accepted[j], position - prompt_len + 1 + j) for position, _, accepted in passes
                  for j in range(1, len(accepted) - 1)
                  if free_run.index(accepted[j]) == position - prompt_len + 1 + j)
    stop, index = inside
    for n in (0, 8):
        result = coder.generate(EDIT_PROMPT, max_new_tokens=NEW_TOKENS, stop_token_ids=[stop], speculate=n)
        assert result.finish_reason == "stop" and result.token_ids == free_run[:index]


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (40, 1.0), (0, 0.9), (40, 0.9)])
def test_sampled_speculation_makes_the_plain_tokens(coder, top_k, top_p):
    kwargs = dict(max_new_tokens=32, temperature=0.8, top_k=top_k, top_p=top_p, seed=5, stop_token_ids=[])
    plain = coder.generate(EDIT_PROMPT, **kwargs)
    result = coder.generate(EDIT_PROMPT, speculate=4, **kwargs)
    assert result.token_ids == plain.token_ids, "a split here can only be a near-tie of two Gumbel keys"
    assert result.accepted_drafts > 0 and result.seed == plain.seed == 5


def test_stream_with_speculation(coder):
    with coder.stream(EDIT_PROMPT, max_new_tokens=40, speculate=4) as stream:
        pieces = list(stream)
    result = stream.result
    plain = coder.generate(EDIT_PROMPT, max_new_tokens=40)
    assert [p.token_id for p in pieces if p.token_id is not None] == result.token_ids == plain.token_ids
    assert "".join(p.text for p in pieces) == result.text == plain.text
    assert result.tokens_per_pass > 1


@pytest.mark.parametrize("speculate", [-1, MAX_DRAFTS + 1, 2.5, True, "4"])
def test_speculate_is_checked(coder, speculate):
    for call in (coder.generate, coder.stream):
        with pytest.raises(GenerationError, match=r"speculate must be an integer in 0\.\.16"):
            call("x", speculate=speculate)
    assert coder.allocator.num_free == coder.allocator.num_pages


def test_a_backend_without_verify_refuses_speculation(coder, monkeypatch):
    monkeypatch.delattr(NumpyBackend, "verify")
    with pytest.raises(GenerationError, match="speculate=4 needs a backend with a verify pass"):
        coder.generate("x", speculate=4)
    assert len(coder.generate("x", max_new_tokens=3, stop_token_ids=[]).token_ids) == 3
