"""tools/check_vs_transformers.py on small models: its parts, and the whole run on the CPU.

The tool runs on the H200 at the 7B's shapes with the CUDA backend; everything except the
device is the same code here: the torch dequantization, the reference built from the file,
transformers' cached decoding, the teacher-forced engine run, the verdict. Each failure mode
the verdict names is provoked once with a deliberately broken backend.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import nanoqwen
from conftest import load_tool
from nanoqwen.reference import backend as backend_numpy
from nanoqwen.backends import cuda_available
from nanoqwen.quant import dequantize_int4, quantize_int4
from nanoqwen.testing import ACCEPTED_SHAPES, make_nanoqwen, reference_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

check = load_tool("check_vs_transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("check_models")
    return {
        "untied": make_nanoqwen(root / "untied", seed=0, tokenizer=False),
        # the 7B's head_dim and 7:1 grouping, tied lm_head
        "tied-gqa7": make_nanoqwen(root / "tied", seed=2, tokenizer=False, num_heads=7, num_kv_heads=1, head_dim=128,
                                   hidden_size=256, intermediate_size=512, tie_word_embeddings=True),
    }


def run_tool(model_path, tmp_path, *extra) -> tuple[int, dict]:
    out = tmp_path / "check.json"
    code = check.main(["--model", str(model_path), "--backend", "numpy", "--device", "cpu", "--json", str(out), *extra])
    return code, json.loads(out.read_text())


def test_torch_dequantization_is_exactly_nanoqwens():
    rng = np.random.default_rng(7)
    # Arbitrary words: every nibble value including 0, and the sign bit set in about half.
    words = rng.integers(0, 1 << 32, size=(24, 48), dtype=np.uint32)
    scales = (rng.standard_normal((24, 3)) * 0.01).astype(np.float16)
    words.setflags(write=False)  # as the loader's memory-mapped views are
    got = check.dequantize_int4_torch(words, scales, "cpu").numpy()
    np.testing.assert_array_equal(got, dequantize_int4(words, scales))

    weight = rng.standard_normal((40, 256)).astype(np.float32)
    qweight, scales = quantize_int4(weight)
    np.testing.assert_array_equal(check.dequantize_int4_torch(qweight, scales, "cpu").numpy(),
                                  dequantize_int4(qweight, scales))


@pytest.mark.parametrize("name", ["untied", "tied-gqa7"])
def test_reference_holds_exactly_the_weights_of_nanoqwen_testing(models, name):
    model = nanoqwen.load(models[name])
    ours = check.hf_reference(model, "cpu").state_dict()
    theirs = reference_model(model).state_dict()
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    assert check.check_dequantize(model, "cpu") == model.config.kv_dim * model.config.hidden_size


def test_whole_run_passes_on_the_numpy_backend(models, tmp_path, capsys):
    code, report = run_tool(models["untied"], tmp_path)
    output = capsys.readouterr().out
    assert code == 0, output
    assert report["passed"] and not report["failures"]
    assert output.rstrip().splitlines()[-1].startswith("PASS")
    assert len(report["steps"]) == 33 and report["counts"]["decode_steps"] == 32
    assert report["counts"]["generate_tokens_checked"] == 33
    assert report["generate_tokens"] == report["reference_tokens"]
    assert report["reference_cache_drift"] < 1e-4
    assert len(set(report["page_table"])) == 5  # 45 + 32 positions, shuffled among the pool's pages
    assert report["page_table"] != sorted(report["page_table"])
    for key in ("date", "command", "torch", "transformers", "gpu", "numpy", "git_commit"):
        assert key in report["environment"]
    first = report["steps"][0]
    assert 0 < first["max_abs_error"] < first["tolerance"]
    # the rounding bound is a few u of the logits, far below what a wrong index or page does
    assert 0 < first["tolerance"] < 0.05 * first["reference_rms"]


# Fixed-size weights (nanoqwen.random_model's, as a trained model's are: not unit-gain), at the
# aspect ratios of the Qwen2 family, where the softmax and SwiGLU gains that carry a rounding to
# the logits differ: the numerics contract, as the numpy backend computes it, must stay within the
# bound the tool measures on each model, with the one factor.
ASPECT_RATIOS = {
    "wide MLP, 7:1": dict(hidden_size=384, intermediate_size=2048, num_heads=6, num_kv_heads=1, head_dim=64),
    "narrow MLP, 5:1, tied": dict(hidden_size=640, intermediate_size=1024, num_heads=5, num_kv_heads=1, head_dim=128,
                                  tie_word_embeddings=True),
    "1:1, head_dim 64": dict(hidden_size=256, intermediate_size=768, num_heads=4, num_kv_heads=4, head_dim=64),
    "8:1 over 16 heads, 4 layers": dict(num_layers=4, hidden_size=1024, intermediate_size=2816, num_heads=16,
                                        num_kv_heads=2, head_dim=64),
    **ACCEPTED_SHAPES,  # head_dim 96, and query heads wider or narrower than hidden
}


@pytest.mark.parametrize("name", ASPECT_RATIOS)
def test_numpy_backend_stays_within_the_measured_bound(name, tmp_path):
    from nanoqwen.config import ModelConfig
    from nanoqwen.random_model import write_random_model

    shape = {"num_layers": 2, "vocab_size": 2000, "tie_word_embeddings": False, **ASPECT_RATIOS[name]}
    config = ModelConfig(max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6, **shape)
    path = write_random_model(tmp_path / "model.nanoqwen", config, seed=3)
    code, report = run_tool(path, tmp_path)
    assert code == 0, report["failures"]
    assert report["counts"]["worst_error_over_tolerance"] < 1


def test_tied_model_at_head_dim_128_passes(models, tmp_path):
    code, report = run_tool(models["tied-gqa7"], tmp_path, "--prompt-tokens", "17", "--steps", "33")
    assert code == 0, report["failures"]
    assert len(report["steps"]) == 34


def test_a_sequence_that_just_fills_the_context_passes(tmp_path, capsys):
    """The check generates steps + 1 tokens after the prompt; all of them may fill the context, one more may not."""
    model = make_nanoqwen(tmp_path / "short", tokenizer=False, max_position_embeddings=49)
    code, report = run_tool(model, tmp_path, "--prompt-tokens", "16", "--steps", "32")
    assert code == 0, report["failures"]
    with pytest.raises(SystemExit, match=r"prompt \(17\) \+ steps \(32\) \+ the prefill's token exceed the model's context 49"):
        run_tool(model, tmp_path, "--prompt-tokens", "17", "--steps", "32")


def test_too_few_steps_fail(models, tmp_path, capsys):
    """Asked for, fewer than 32 steps are a usage error; compared (a context too short), a failure."""
    with pytest.raises(SystemExit) as error:
        run_tool(models["untied"], tmp_path, "--steps", "4")
    assert error.value.code == 2 and "at least 32" in capsys.readouterr().err
    failures, _ = check.verdict([], 4, [], [])
    assert failures == ["only 4 decode steps compared; at least 32 are required"]


def test_wrong_logits_fail(models, tmp_path, monkeypatch):
    decode = backend_numpy.NumpyBackend.decode

    def off_by_one_position(self, token_id, position, page_table):  # a RoPE / cache-row bug
        if position == 50:
            position += 1
        return decode(self, token_id, position, page_table)

    monkeypatch.setattr(backend_numpy.NumpyBackend, "decode", off_by_one_position)
    code, report = run_tool(models["untied"], tmp_path, "--no-poison")
    assert code == 1
    assert any("above tolerance at steps [6," in f for f in report["failures"]), report["failures"]


def test_reading_an_unwritten_cache_row_fails(models, tmp_path, monkeypatch):
    decode = backend_numpy.NumpyBackend.decode

    def skips_a_write(self, token_id, position, page_table):
        if position == 60:  # computes the token without storing its K/V, so position 61 reads poison
            saved = self.kv_pool.copy()
            logits = decode(self, token_id, position, page_table)
            self.kv_pool[...] = saved
            return logits
        return decode(self, token_id, position, page_table)

    monkeypatch.setattr(backend_numpy.NumpyBackend, "decode", skips_a_write)
    code, report = run_tool(models["untied"], tmp_path)
    assert code == 1
    assert any("NaN" in f for f in report["failures"]), report["failures"]


def test_greedy_generation_that_ignores_its_logits_fails(models, tmp_path, monkeypatch):
    def wrong_argmax(self, token_id, position, page_table, sampling=None):
        logits = self.decode(token_id, position, page_table)
        return int(np.argsort(logits)[-2])  # the runner-up

    monkeypatch.setattr(backend_numpy.NumpyBackend, "decode_next", wrong_argmax)
    code, report = run_tool(models["untied"], tmp_path)
    assert code == 1
    assert len(report["failures"]) == 1 and "Engine.generate's token 1" in report["failures"][0]


def record(step, margin, agree, tol=0.1, error=0.01):
    return dict(step=step, max_abs_error=error, tolerance=tol, error_over_tolerance=error / tol, margin=margin,
                reference_rms=1.0, reference_token=step, nanoqwen_token=step if agree else -1, nanoqwen_margin=1.0,
                agree=agree, near_tie=margin <= 2 * tol)


def test_verdict_forgives_disagreement_only_at_near_ties():
    steps = 32
    records = [record(s, 1.0, True) for s in range(steps + 1)]
    tokens = list(range(steps + 1))
    assert check.verdict(records, steps, tokens, tokens)[0] == []

    records[5] = record(5, 0.15, False)  # margin below 2 x tolerance: a near-tie
    failures, counts = check.verdict(records, steps, tokens[:5] + [-1] + tokens[6:], tokens)
    assert failures == []
    assert counts["disagreements"] == counts["disagreements_at_near_ties"] == 1
    assert counts["generate_tokens_checked"] == 6

    records[5] = record(5, 0.25, False)  # margin above 2 x tolerance: a real disagreement
    failures, _ = check.verdict(records, steps, tokens[:5] + [-1] + tokens[6:], tokens)
    assert len(failures) == 1 and "disagree at steps [5]" in failures[0]


def test_bad_arguments_are_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        check.main(["--model", str(tmp_path / "missing.nanoqwen")])
    assert "no such file" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not (cuda_available() and torch.cuda.is_available()), reason="needs CuPy, a CUDA GPU and CUDA torch")
def test_whole_run_passes_on_the_cuda_backend(models, tmp_path):
    out = tmp_path / "check.json"
    code = check.main(["--model", str(models["tied-gqa7"]), "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report["failures"]
    assert report["environment"]["gpu"]
