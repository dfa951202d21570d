"""The nano-coder model shipped in the package: the file, its provenance, the engine on it, the CLI.

nano-coder is the one trained model every CPU test and chapter can run (tools/nano_coder/
trains it; chapter 11 describes it). These tests pin down that the shipped pieces belong
together: the .nanoqwen file is exactly what `nanoqwen convert` makes of the Hugging Face
checkpoint beside it, that checkpoint is the one train_log.json describes, and the numpy
engine computes on it what transformers computes on the same (dequantized) weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import nanoqwen
from nanoqwen import cli
from nanoqwen.cli import DEFAULT_MODEL
from nanoqwen.config import ModelConfig
from nanoqwen.convert import convert
from nanoqwen.engine import Engine
from nanoqwen.testing import reference_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The engine-vs-transformers tolerance is derived (fp16 rounding points of a forward pass) in
# test_engine_numpy.py; pytest puts tests/ on sys.path, so it is reused rather than restated.
from test_engine_numpy import tolerance  # noqa: E402

CHECKPOINT = Path(__file__).resolve().parents[1] / "tools" / "nano_coder" / "checkpoint"  # training's output
# A prompt from no file of the training corpus, long enough to span two KV pages (16 tokens each).
CODE_PROMPT = (
    "import os\n\n\n"
    "def read_lines(path):\n"
    '    """Return the non-empty lines of a text file."""\n'
    "    if not os.path.exists(path):\n"
    "        return []\n"
    "    with open(path) as f:\n"
)
DECODE_STEPS = 32
# The logged samples were taken from the fp32 training weights; the checkpoint holds them
# rounded to fp16 (relative error 2^-11), which moves logits of size ~10 by ~0.01. A
# different run's weights would disagree by whole logits.
SAMPLE_LOGIT_SLACK = 0.1


@pytest.fixture(scope="module")
def model():
    return nanoqwen.load(DEFAULT_MODEL, verify_checksums=True)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, backend="numpy")


@pytest.fixture(scope="module")
def train_log():
    return json.loads((CHECKPOINT / "train_log.json").read_text())


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_shipped_file_loads_validates_and_matches_the_hf_config(model, train_log):
    hf_config = json.loads((CHECKPOINT / "config.json").read_text())
    assert model.config == ModelConfig.from_hf(hf_config)
    hp = train_log["hyperparameters"]
    c = model.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        hp["num_hidden_layers"], hp["hidden_size"], hp["intermediate_size"], hp["num_attention_heads"],
        hp["num_key_value_heads"], hp["vocab_size"])
    assert c.tie_word_embeddings and c.rope_theta == hp["rope_theta"]
    for name, blob in model.tokenizer_files.items():
        assert blob == (CHECKPOINT / name).read_bytes(), f"the tokenizer blob {name} differs from the checkpoint's"


def test_shipped_file_is_the_checkpoint_converted(tmp_path):
    # Byte for byte: a retrained checkpoint committed without re-running `nanoqwen convert`
    # (or a converter change that alters the output) shows up here.
    out = tmp_path / "again.nanoqwen"
    summary = convert(str(CHECKPOINT), out, progress=False)
    assert out.read_bytes() == DEFAULT_MODEL.read_bytes(), (
        f"{DEFAULT_MODEL.name} is not what `nanoqwen convert {CHECKPOINT}` makes today: re-run it"
    )
    assert summary["parameters"] == json.loads((CHECKPOINT / "train_log.json").read_text())["hyperparameters"]["parameters"]


def test_checkpoint_is_the_logged_run(train_log):
    """The fp16 checkpoint, fed each logged greedy sample, picks the logged token at every step."""
    from tokenizers import Tokenizer

    hf = transformers.Qwen2ForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float16).eval()
    tok = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))
    for sample in train_log["samples"]:
        prompt = tok.encode(sample["prompt"], add_special_tokens=False).ids
        completion = np.array(sample["completion_ids"])
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + completion.tolist()])).logits[0].float().numpy()
        logits = logits[len(prompt) - 1 : -1]  # the logits that chose each completion token
        shortfall = logits.max(axis=1) - logits[np.arange(len(completion)), completion]
        assert shortfall.max() <= SAMPLE_LOGIT_SLACK, (
            f"sample {sample['name']!r}: at step {shortfall.argmax()} the checkpoint prefers another token by "
            f"{shortfall.max():.3f} logits: these weights are not the ones train_log.json describes"
        )


def test_numpy_engine_matches_transformers_on_code(model, engine):
    prompt = engine.tokenizer.encode(CODE_PROMPT)
    table = engine.allocator.allocate(-(-(len(prompt) + DECODE_STEPS) // 16))
    engine.backend.kv_pool[...] = np.nan  # a read of a row nobody wrote shows up as NaN
    try:
        logits = [engine.backend.prefill(np.array(prompt), 0, table)]
        tokens = [int(np.argmax(logits[0]))]
        for step in range(DECODE_STEPS - 1):
            logits.append(engine.backend.decode(tokens[-1], len(prompt) + step, table))
            tokens.append(int(np.argmax(logits[-1])))
    finally:
        engine.allocator.free(table)

    with torch.no_grad():
        ids = torch.tensor([prompt + tokens[:-1]])
        expected = reference_model(model)(ids).logits[0, len(prompt) - 1 :].numpy()
    errors = np.abs(np.array(logits) - expected).max(axis=1)
    tol = tolerance(model.config, expected)
    assert np.isfinite(errors).all()
    assert errors.max() < tol, f"worst logit error {errors.max():.4g} at step {errors.argmax()} exceeds {tol:.4g}"
    # Greedy paths agree wherever the reference's choice is not a near-tie the two could split.
    top2 = np.sort(expected, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * errors.max()
    first_split = next((s for s, (a, b) in enumerate(zip(tokens, expected.argmax(axis=1))) if a != b), None)
    assert first_split is None or not decided[first_split], (
        f"step {first_split}: engine token {tokens[first_split]}, transformers {expected[first_split].argmax()}"
    )


def test_generate_with_no_model_argument_writes_python(capsys):
    status, stdout, stderr = run_cli(capsys, "generate", "def fibonacci(n):", "--max-new-tokens", 32,
                                     "--backend", "numpy")
    assert status == 0, stderr
    assert "return" in stdout or "if " in stdout, f"no Python keyword in {stdout!r}"
    assert "finished by" in stderr and "on numpy" in stderr
    expected = Engine(DEFAULT_MODEL, backend="numpy").generate("def fibonacci(n):", max_new_tokens=32)
    assert stdout == expected.text + "\n"


def test_fill_in_the_middle_runs(capsys, engine):
    prefix, suffix = "def is_even(n):\n    return ", "\n\n\nprint(is_even(4))\n"
    result = engine.generate(prefix, fim_suffix=suffix, max_new_tokens=16)
    tok = engine.tokenizer
    ids = result.prompt_token_ids
    assert ids[0] == tok.token_id("<|fim_prefix|>") == 8189 and ids[-1] == tok.token_id("<|fim_middle|>") == 8190
    assert tok.token_id("<|fim_suffix|>") in ids
    assert result.token_ids and result.text
    status, stdout, _ = run_cli(capsys, "generate", prefix, "--fim-suffix", suffix, "--max-new-tokens", 16,
                                "--backend", "numpy")
    assert status == 0 and stdout == result.text + "\n"


def test_chat_prompt_runs(engine):
    # nano-coder never saw a conversation: this checks the path, not the answer.
    result = engine.generate("Reverse a string in Python.", chat=True, max_new_tokens=8)
    assert engine.tokenizer.decode(result.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert len(result.token_ids) >= 1
