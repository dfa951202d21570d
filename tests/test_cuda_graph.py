"""The captured decode graph against eager launches and the numpy backend (GPU only).

Graph and eager run the same kernels on the same inputs, so their logits must be bitwise
equal; the numpy backend is the oracle, so greedy tokens must agree with it on the shipped
nano-coder, whose trained logits have clear margins.
"""

import numpy as np
import pytest

from nanoqwen import sampling as sampling_module
from nanoqwen.cuda.abi import TOP_K_MAX
from nanoqwen.engine import Engine
from nanoqwen.backends import cuda_available
from nanoqwen.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU"),
]

PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def engines():
    from nanoqwen.cli import DEFAULT_MODEL as path

    cuda, numpy_engine = Engine(path, backend="cuda"), Engine(path, backend="numpy")
    yield cuda, numpy_engine
    cuda.close()
    numpy_engine.close()


def test_graph_and_eager_logits_are_bitwise_equal(engines):
    cuda, _ = engines
    backend = cuda.backend
    ids = np.array(cuda.tokenizer.encode(PROMPTS[0]), dtype=np.int32)
    pages = cuda.allocator.allocate(4)
    try:
        logits = {}
        for use_graph in (False, True):
            backend.use_graph = use_graph
            token = int(np.argmax(backend.prefill(ids, 0, pages)))
            steps = []
            for step in range(20):  # crosses from page 0 into page 1 on the device alone
                steps.append(backend.decode(token, len(ids) + step, pages))
                token = int(np.argmax(steps[-1]))
            logits[use_graph] = np.stack(steps)
        assert np.array_equal(logits[False], logits[True])
    finally:
        backend.use_graph = True
        cuda.allocator.free(pages)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_the_numpy_backend(engines, prompt):
    cuda, numpy_engine = engines
    want = numpy_engine.generate(prompt, max_new_tokens=64, stop_token_ids=[]).token_ids
    got = cuda.generate(prompt, max_new_tokens=64, stop_token_ids=[]).token_ids
    assert got == want


@pytest.mark.parametrize("sampling", [dict(temperature=0.8, seed=11), dict(temperature=1.5, seed=12),
                                      dict(temperature=0.8, top_k=20, top_p=0.9, seed=13),
                                      dict(temperature=0.8, top_k=40, seed=14), dict(temperature=0.8, top_p=0.9, seed=15),
                                      dict(temperature=0.8, top_k=2000, seed=16)])
def test_sampled_tokens_match_the_numpy_backend(engines, sampling):
    """Temperature, top-k (with top-p or not) and top-p alone are drawn on the device, in the graph; a
    top-k above TOP_K_MAX on the host. All draw what the numpy backend draws from the same seed
    (nanoqwen.sampling)."""
    cuda, numpy_engine = engines
    want = numpy_engine.generate(PROMPTS[0], max_new_tokens=48, stop_token_ids=[], **sampling)
    got = cuda.generate(PROMPTS[0], max_new_tokens=48, stop_token_ids=[], **sampling)
    assert got.token_ids == want.token_ids and got.seed == want.seed == sampling["seed"]
    assert got.token_ids != cuda.generate(PROMPTS[0], max_new_tokens=48, stop_token_ids=[]).token_ids


def test_a_top_p_alone_hands_long_runs_to_the_host(engines, monkeypatch):
    """At temperature 1 the nano-coder's top-p of 0.99 runs past the 1024 tokens the device keeps
    at some steps (10 of these 24): exactly those are drawn on the host, the others on the device,
    and together they draw what the numpy backend draws. A peaked distribution hands none back."""
    cuda, numpy_engine = engines
    sampling = dict(temperature=1.0, top_p=0.99, seed=17)
    runs = []
    def recording_nucleus(scaled, ids, top_p, run=sampling_module.nucleus):
        kept = run(scaled, ids, top_p)
        runs.append(len(kept))
        return kept
    with monkeypatch.context() as patch:
        patch.setattr(sampling_module, "nucleus", recording_nucleus)
        want = numpy_engine.generate(PROMPTS[1], max_new_tokens=24, stop_token_ids=[], **sampling)
    long_runs = sum(length > TOP_K_MAX for length in runs)
    assert len(runs) == 24 and 0 < long_runs < 24
    before = cuda.backend.host_draws
    got = cuda.generate(PROMPTS[1], max_new_tokens=24, stop_token_ids=[], **sampling)
    assert got.token_ids == want.token_ids
    assert cuda.backend.host_draws - before == long_runs
    cuda.generate(PROMPTS[1], max_new_tokens=24, stop_token_ids=[], temperature=0.5, top_p=0.5, seed=18)
    assert cuda.backend.host_draws - before == long_runs


def test_logits_for_the_host_leave_the_sampler_greedy(engines):
    """A step whose token the host chooses does not pay for the last request's device draw: the
    filtered select in argmax_select_next costs 66 us or more at the 7B's vocabulary
    (results/kernels-h200.md)."""
    cuda, _ = engines
    cuda.generate(PROMPTS[0], max_new_tokens=4, temperature=0.8, top_k=20, seed=1)
    assert cuda.backend.sampler.get().any()  # the request's settings are still there
    cuda.generate(PROMPTS[0], max_new_tokens=4, temperature=0.8, top_k=2000, seed=1)  # drawn on the host
    assert not cuda.backend.sampler.get().any()


def test_launch_count_is_fixed(engines):
    cuda, _ = engines
    c = cuda.config
    graph = cuda.backend.decode_graph()
    assert graph.launches == cuda.backend.launches_per_token
    assert graph.launches > 7 * c.num_layers  # every layer is at least seven launches


def _decode_logits(engine, prompt: str, steps: int, feed=None):
    """Logits of prefill and `steps` decode steps, feeding `feed` tokens (default: greedy)."""
    backend = engine.backend
    ids = np.array(engine.tokenizer.encode(prompt), dtype=np.int32)
    pages = engine.allocator.allocate(4)
    try:
        logits, tokens = [backend.prefill(ids, 0, pages)], []
        for step in range(steps):
            tokens.append(int(np.argmax(logits[-1])) if feed is None else feed[step])
            logits.append(backend.decode(tokens[-1], len(ids) + step, pages))
        return np.stack(logits), tokens
    finally:
        engine.allocator.free(pages)


def test_int8_activations_path_runs_in_the_graph(engines):
    """Path A (chapter 8) in the engine: graph equals eager bitwise, and, fed the same tokens,
    its logits stay close to Path B's (INT8 activations cost ~2% relative error per
    projection; they do not make a different model)."""
    from nanoqwen.cli import DEFAULT_MODEL

    cuda, _ = engines
    int8 = Engine(DEFAULT_MODEL, backend="cuda", activations="int8")
    try:
        assert int8.backend.launches_per_token > cuda.backend.launches_per_token
        reference, tokens = _decode_logits(cuda, PROMPTS[1], 12)
        int8.backend.use_graph = False
        eager, _ = _decode_logits(int8, PROMPTS[1], 12, feed=tokens)
        int8.backend.use_graph = True
        graphed, _ = _decode_logits(int8, PROMPTS[1], 12, feed=tokens)
        assert np.array_equal(eager, graphed)
        relative = np.linalg.norm(graphed[1:] - reference[1:]) / np.linalg.norm(reference[1:])
        assert relative < 0.1, relative
    finally:
        int8.close()


def test_non_finite_logits_raise_in_graph_greedy_decode(engines):
    """The numpy backend raises on NaN logits; the graph's on-device argmax must not pick a token
    silently either (kernels/sampler.cu's status word). The lm_head row is poisoned after the
    prefill (whose host-side sampling would raise first) and restored afterwards."""
    cuda, _ = engines
    backend = cuda.backend
    ids = np.array(cuda.tokenizer.encode(PROMPTS[0]), dtype=np.int32)
    pages = cuda.allocator.allocate(2)
    lm_head = backend.lm_head
    row = lm_head.shape[0] - 1  # a token the prompt does not use
    saved = lm_head[row].copy()
    try:
        token = int(np.argmax(backend.prefill(ids, 0, pages)))
        token = backend.decode_next(token, len(ids), pages)  # clean: fine
        lm_head[row, 3] = np.float16(np.nan)
        with pytest.raises(FloatingPointError, match="not finite"):
            backend.decode_next(token, len(ids) + 1, pages)
        lm_head[row] = saved
        backend.decode_next(token, len(ids) + 1, pages)  # status cleared by the next upload
    finally:
        lm_head[row] = saved
        cuda.allocator.free(pages)


def test_pipelined_greedy_tokens_equal_step_by_step(engines):
    """CudaBackend.next_tokens keeps one step queued ahead of the one it reads; the tokens must
    be those of one decode_next call per step."""
    cuda, _ = engines
    backend = cuda.backend
    ids = np.array(cuda.tokenizer.encode(PROMPTS[1]), dtype=np.int32)
    pages = cuda.allocator.allocate(4)
    try:
        first = int(np.argmax(backend.prefill(ids, 0, pages)))
        ahead = list(backend.next_tokens(first, len(ids), pages, 40))
        first = int(np.argmax(backend.prefill(ids, 0, pages)))
        one_by_one, token = [], first
        for k in range(40):
            token = backend.decode_next(token, len(ids) + k, pages)
            one_by_one.append(token)
        assert ahead == one_by_one
        params = SamplingParams(temperature=1.0, seed=5)  # the same for tokens the device samples
        ahead = list(backend.next_tokens(first, len(ids), pages, 40, params))
        one_by_one, token = [], first
        for k in range(40):
            token = backend.decode_next(token, len(ids) + k, pages, params)
            one_by_one.append(token)
        assert ahead == one_by_one and ahead != list(backend.next_tokens(first, len(ids), pages, 40))
    finally:
        cuda.allocator.free(pages)


def test_stopping_early_leaves_the_engine_consistent(engines):
    """A stop token ends a pipelined run with one step already queued; the next request must not
    see it."""
    cuda, numpy_engine = engines
    want = numpy_engine.generate(PROMPTS[2], max_new_tokens=40, stop_token_ids=[]).token_ids
    stop = want[12]
    got = cuda.generate(PROMPTS[2], max_new_tokens=40, stop_token_ids=[stop]).token_ids
    assert got == want[: want.index(stop)]
    assert cuda.generate(PROMPTS[0], max_new_tokens=24, stop_token_ids=[]).token_ids == \
        numpy_engine.generate(PROMPTS[0], max_new_tokens=24, stop_token_ids=[]).token_ids
