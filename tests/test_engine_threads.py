"""One Engine, many threads: requests serialize on the engine's lock, a backend's queued work is
never resumed after another request used the backend, and close() from another thread ends a
running request with GenerationError("engine is closed"), never a KeyError from a closed model.
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from nanoqwen.engine import Engine
from nanoqwen.errors import GenerationError
from nanoqwen.testing import make_nanoqwen

PROMPTS = [np.random.default_rng(seed).integers(0, 500, 9 + 7 * seed).tolist() for seed in range(4)]
STEPS = 24


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_nanoqwen(tmp_path_factory.mktemp("threads"))


@pytest.fixture(scope="module")
def alone(model_path):
    """Each prompt's greedy tokens, generated with nothing else running."""
    with Engine(model_path, backend="numpy") as engine:
        return [engine.generate(p, max_new_tokens=STEPS, stop_token_ids=[]).token_ids for p in PROMPTS]


def run_in_threads(*targets) -> list:
    """Run each target in its own thread; return what each returned or raised."""
    outcomes = [None] * len(targets)

    def run(i, target):
        try:
            outcomes[i] = target()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i, t)) for i, t in enumerate(targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return outcomes


def alternate(streams) -> list[list[int]]:
    """Every stream's token ids, taking one piece from each in turn in one thread."""
    tokens = [[] for _ in streams]
    for pieces in itertools.zip_longest(*streams):
        for got, piece in zip(tokens, pieces):
            if piece is not None and piece.token_id is not None:
                got.append(piece.token_id)
    return tokens


class QueueCheckingBackend:
    """A NumpyBackend whose next_tokens generators fail, as the CUDA backend's queued step would go
    wrong, when resumed after another request's call into the backend."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill(self, *args):
        self.calls += 1
        return self.inner.prefill(*args)

    def next_tokens(self, *args):
        for token in self.inner.next_tokens(*args):
            self.calls += 1
            mine = self.calls
            yield token
            assert self.calls == mine, "a queued step was resumed after another request used the backend"


def test_concurrent_generate_calls_each_get_their_own_answer(model_path, alone):
    with Engine(model_path, backend="numpy") as engine:
        engine.backend = QueueCheckingBackend(engine.backend)
        outcomes = run_in_threads(*[lambda p=p: engine.generate(p, max_new_tokens=STEPS, stop_token_ids=[]).token_ids
                                    for p in PROMPTS])
        assert outcomes == alone
        assert engine.allocator.num_free == engine.allocator.num_pages


def test_streams_in_several_threads_take_turns_step_by_step(model_path, alone):
    with Engine(model_path, backend="numpy") as engine:
        engine.backend = QueueCheckingBackend(engine.backend)

        def consume(prompt):
            return [piece.token_id for piece in engine.stream(prompt, max_new_tokens=STEPS, stop_token_ids=[])
                    if piece.token_id is not None]

        assert run_in_threads(*[lambda p=p: consume(p) for p in PROMPTS]) == alone
        # and in one thread, alternating: each switch drops the other's queued work
        streams = [engine.stream(p, max_new_tokens=STEPS, stop_token_ids=[]) for p in PROMPTS[:2]]
        tokens = alternate(streams)
        assert tokens == alone[:2]
        assert engine.allocator.num_free == engine.allocator.num_pages


def test_threads_that_share_one_stream_take_its_pieces_in_turn(model_path, alone):
    with Engine(model_path, backend="numpy") as engine:
        stream = engine.stream(PROMPTS[0], max_new_tokens=STEPS, stop_token_ids=[])
        taken = run_in_threads(*[lambda: [piece.token_id for piece in stream] for _ in range(4)])
        assert sorted(t for ids in taken for t in ids if t is not None) == sorted(alone[0])
        assert stream.result.token_ids == alone[0] and engine.allocator.num_free == engine.allocator.num_pages


def test_interleaved_speculative_streams_resume_from_their_last_chosen_token(model_path, alone):
    """A verify pass may choose several tokens that the stream yields one at a time; another stream
    running in between makes the first one start its passes again from the last token it chose."""
    with Engine(model_path, backend="numpy") as engine:
        streams = [engine.stream(p, max_new_tokens=STEPS, stop_token_ids=[], speculate=4) for p in PROMPTS[:2]]
        tokens = alternate(streams)
        assert tokens == alone[:2]
        assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.parametrize("run", range(8))
def test_close_during_generate_ends_it_cleanly(model_path, run):
    engine = Engine(model_path, backend="numpy")  # it opened the file: close() unmaps the weights
    stepping = threading.Event()
    real_decode_next = engine.backend.decode_next

    def decode_next(*args, **kwargs):  # a step long enough for close() to land inside it
        stepping.set()
        time.sleep(0.02)
        return real_decode_next(*args, **kwargs)

    engine.backend.decode_next = decode_next

    def close_when_stepping():
        assert stepping.wait(timeout=60)
        engine.close()

    outcome, closed = run_in_threads(lambda: engine.generate(PROMPTS[run % 4], max_new_tokens=600, stop_token_ids=[]),
                                     close_when_stepping)
    assert closed is None, repr(closed)
    assert isinstance(outcome, GenerationError) and str(outcome) == "engine is closed", repr(outcome)
    assert engine.allocator.num_free == engine.allocator.num_pages
    with pytest.raises(GenerationError, match="engine is closed"):
        engine.generate("x")


def test_close_from_another_thread_ends_a_stream_mid_way(model_path):
    engine = Engine(model_path, backend="numpy")
    stream = engine.stream(PROMPTS[0], max_new_tokens=STEPS, stop_token_ids=[])
    first = next(stream)
    assert run_in_threads(engine.close) == [None]
    with pytest.raises(GenerationError, match="engine is closed"):
        next(stream)
    assert first.token_id is not None and engine.allocator.num_free == engine.allocator.num_pages
